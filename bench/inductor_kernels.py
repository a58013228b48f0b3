"""The fusion model (``advisor/profile/fusion.py``) against the Triton kernels inductor writes for
a GPU, on a host without one: per block (a model's first) and direction, the bytes the operators
without FLOPs move and the kernels they launch, as the profile counts them and as inductor's
generated code launches them (each kernel's bytes as inductor estimates them, ``kernel_num_gb``,
with the corrections of :func:`_kernel_bytes`). In a convolutional block of an NCHW model,
inductor's count holds the copies of the block's input and output into and out of channels-last,
which the cost model prices apart (``cost/convolutions.py``, ``layout_transform_bytes``).

Each block is compiled on CPU fake tensors under CPU autocast, its joint graph split by inductor's
own joint-graph passes and partitioner, its forward and backward graphs kept as AOTAutograd hands
them to inductor, then lowered for a CUDA device that answers inductor's
queries as one H100 would (132 SMs, sm90); each kernel's source is kept instead of compiled, so
nothing runs on a device. The graphs are the CPU's: CPU autocast, whose float32 list is shorter
than CUDA's (profile/autocast.py), and the CPU's attention kernel. The profile's emulation of
CUDA's list and kernel (which its own trace runs under ``aot_function``) cannot stand in here:
dynamo breaks a block traced under it into several graphs (at the emulation's
``super().unflatten()``), each writing out what one compiled block keeps in registers. A block
captured as more than one graph in a direction is said so on the line. Where lowering for the
faked CUDA device fails, the graph is lowered for the CPU device with the Triton backend instead,
and the line says so: that lowering always writes a ``cat``
out, and leaves loop reordering and mixed-order reductions off. Needs Triton beside torch, in a venv
of its own (the project's does not install it):

    python3 -m venv /tmp/triton-venv && /tmp/triton-venv/bin/pip install torch==2.13.0 triton==3.5.0 \
        transformers==5.24.0  # for hf: configs
    PYTHONPATH=. /tmp/triton-venv/bin/python bench/inductor_kernels.py [MODEL:SEQ_LEN ...]

Each block is compiled at two batch sizes, which splits its bytes into those that grow with the
batch (per sample) and those that do not (the weights' casts). Written against torch 2.13.0 and
Triton 3.5.0: it answers several of inductor's device queries and replaces one function of its
reinplace pass (:func:`_fake_h100`), which other versions may name differently.
"""

from __future__ import annotations

import collections
import copy
import math
import re
import sys
import time
import types
from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from stratagem.advisor.profile.cache import PROFILE_BATCH, profile_spec
from stratagem.advisor.profile.fusion import covered_elements
from stratagem.advisor.profile.structure import find_blocks
from stratagem.verify.models import real_model

CASES = ("gpt2-large:1024", "vit-l-16:-", "llama-2-7b:1024", "hf:bench/configs/pythia-410m:1024",
         # written after the fusion model, never tuned on
         "hf:bench/configs/opt-1.3b:1024", "hf:bench/configs/bloom-560m:1024", "hf:bench/configs/qwen2.5-1.5b:1024",
         "resnet-101:-")  # its first block: convolutions and BatchNorm
BATCHES = (4 * PROFILE_BATCH, 16 * PROFILE_BATCH)  # large enough that inductor splits the sums across rows
H100 = dict(multi_processor_count=132, major=9, minor=0, regs_per_multiprocessor=65536,
            max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32)


class Launch(NamedTuple):
    backward: bool
    kernel: str  # triton_{poi,red,per}_... or extern_kernels.<op>
    num_bytes: float


class Split(NamedTuple):
    """A block direction's bytes: per sample and fixed, and its kernels."""

    per_sample: float
    fixed: float
    kernels: int


def _fake_h100() -> None:
    """Make inductor lower and generate Triton code for ``cuda:0`` as for one H100, on a CPU-only
    torch, keeping each kernel's source (:data:`SOURCES`) instead of compiling it."""
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.config as config
    import torch._inductor.scheduler as scheduler
    from torch._inductor.fx_passes import reinplace
    import torch.utils._triton as triton_utils
    from torch._inductor import async_compile
    from torch._inductor.codegen import simd
    from torch._inductor.codegen import triton as triton_codegen
    from torch._inductor.runtime import hints

    config.compile_threads = 1
    config.benchmark_kernel = True  # puts kernel_num_gb into each kernel's metadata
    config.cpu_backend = "triton"  # for graphs lowered for the CPU device instead
    config.fx_graph_cache = False
    card = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, L2_cache_size=50 * 2**20,
                                 gcnArchName="", **H100)
    hints.DeviceProperties.create = classmethod(lambda cls, device: hints.DeviceProperties(
        type="cuda", index=0, cc=90, **{k: v for k, v in H100.items() if k != "minor"}))
    answers = dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                   get_device_properties=lambda device=None: card, get_device_capability=lambda device=None: (9, 0),
                   get_rng_state=lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8),
                   set_rng_state=lambda *args, **kwargs: None, _exchange_device=lambda index: 0,
                   _maybe_exchange_device=lambda index: 0)
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    cuda = device_interface.CudaInterface
    for name in ("is_available", "device_count", "current_device", "get_device_properties"):
        setattr(cuda, name, staticmethod(answers[name]))
    cuda.get_compute_capability = staticmethod(lambda device=None: 90)
    cuda.Worker.get_device_properties = staticmethod(answers["get_device_properties"])
    cuda.Worker.current_device = staticmethod(answers["current_device"])
    torch._C._cuda_getCurrentRawStream = lambda index=0: 0  # imported by the modules inductor writes
    triton_utils.has_triton = scheduler.has_triton = lambda: True
    # the pass that makes scatters in place checks each one by copying between fake tensors, which
    # takes a CUDA device guard: the same check without the copy (the function stays the same
    # object: the pass finds its nodes by it)
    reinplace._inplace_generalized_scatter.__code__ = _scatter_checked_by_shape.__code__
    # a seeded random operator's seed, as fake tensor propagation sees it: its meta function indexes
    # the seeds, which on a torch built without CUDA cannot run for a CUDA tensor
    torch.ops.prims.inductor_lookup_seed.default.prim_meta_impl = lambda seeds, index: seeds.new_empty(())
    triton_utils.triton_hash_with_backend = triton_codegen.triton_hash_with_backend = lambda: "0" * 64
    triton_utils.triton_backend = lambda: None

    def keep_source(self, kernel_name: str, source_code: str, device_str: str = "cuda"):
        found = re.search(r"'kernel_num_gb': ([0-9.e+-]+)", source_code)
        numels = re.findall(r"^    (?:[xyz]|r\d_)numel = (\d+)$", source_code, flags=re.M)
        SOURCES[kernel_name] = (float(found.group(1)) * 1e9 if found else 0.0, [int(numel) for numel in numels])
        return types.SimpleNamespace(run=lambda *args, **kwargs: None)

    async_compile.AsyncCompile.triton = keep_source
    async_compile.AsyncCompile.wait = lambda self, scope: None
    simd.SIMDKernel.estimate_kernel_num_bytes = _kernel_bytes


def _kernel_bytes(kernel) -> int:
    """The bytes a kernel's loads and stores cover (``kernel_num_gb`` = this / 1e9), in place of
    inductor's estimate. Inductor's counts a buffer larger than the kernel's loop (one it slices)
    once per distinct index it is read at, each the loop's size: a partial rotary embedding reads
    the quarter of each head it rotates, the rest, and halves of the quarter, from the Q/K/V GEMM's
    output (Pythia's), each read counted at the kernel's whole size. Here such a buffer counts the
    elements its accesses cover (:func:`_footprint`); any other the whole buffer, as inductor's.
    And inductor counts a buffer the kernel writes in place as read and written; here it is read
    only where the kernel's code loads it (the kernel that assembles Pythia's Q/K/V gradient
    writes into the GEMM output's buffer without reading it)."""
    from torch._inductor.utils import IndentedBuffer, get_dtype_size, sympy_product
    from torch._inductor.virtualized import V

    hint = V.graph.sizevars.optimization_hint
    loop = hint(sympy_product(kernel.numels.values()))
    accesses = kernel.features.buf_accesses()
    code = "".join(buffer.getvalue() for buffer in vars(kernel).values() if isinstance(buffer, IndentedBuffer))
    # the first arguments: buffers written in place, read as well where the kernel loads them
    in_place = [f"tl.load({buffer.inner_name} " in code
                for buffer in {id(b): b for b in kernel.args.inplace_buffers.values()}.values()]
    total = 0
    for position, name in enumerate(kernel.args.python_argdefs()[1]):
        if name not in accesses:
            continue
        numel = hint(V.graph.get_numel(name))
        covered = numel if numel <= loop else _footprint(accesses[name], numel, len(accesses[name]) * loop)
        read_too = position < len(in_place) and in_place[position]
        total += covered * get_dtype_size(V.graph.get_dtype(name)) * (1 + read_too)
    return total


def _footprint(deps: list, numel: int, otherwise: int) -> int:
    """Elements of a buffer of ``numel`` that ``deps`` (a kernel's accesses of it) cover: each an
    affine index over its loop's ranges, a strided view of the buffer, of which what falls outside
    it is a masked access (a ``cat``'s other part: ``x[i - 8]`` where ``i >= 8``); ``otherwise``
    where an index is not affine."""
    from torch._inductor.dependencies import MemoryDep
    from torch.utils._sympy.functions import Identity

    views = []
    for dep in deps:
        if not isinstance(dep, MemoryDep):
            return otherwise
        index = dep.index
        while index.has(Identity):  # inductor's wrapper, for grouping: nested at times
            index = index.replace(Identity, lambda inner: inner)
        index = sympy.expand(index)
        offset = index.subs({var: 0 for var in dep.var_names})
        strides = [index.coeff(var) for var in dep.var_names]
        if not all(term.is_Integer for term in map(sympy.sympify, (offset, *strides, *dep.size))) \
                or min(strides, default=0) < 0 \
                or sympy.expand(index - offset - sum(s * v for s, v in zip(strides, dep.var_names))) != 0:
            return otherwise
        views.append(([int(n) for n in dep.size], [int(s) for s in strides], int(offset)))
    return covered_elements(views, numel)


def _scatter_checked_by_shape(inp, src, view_ops):
    """``reinplace._inplace_generalized_scatter`` without copying ``src`` into the view: a shape check."""
    tmp = inp
    for view in view_ops:
        args, kwargs = pytree.tree_map(lambda node: node.meta["val"] if isinstance(node, torch.fx.Node) else node,
                                       (view.args, view.kwargs))
        fake_mode = detect_fake_mode(args)
        with fake_mode.shape_env.ignore_fresh_unbacked_symbols() if fake_mode and fake_mode.shape_env else nullcontext():
            tmp = view.target(tmp, *args, **kwargs)
    torch.broadcast_shapes(src.shape, tmp.shape)
    return inp


SOURCES: dict[str, tuple[float, list[int]]] = {}  # kernel name -> (bytes, by :func:`_kernel_bytes`; its loops' sizes)


class Graph(NamedTuple):
    backward: bool
    module: torch.fx.GraphModule
    inputs: list


def capture(spec: str, batch: int, seq_len: int | None) -> list[Graph]:
    """The forward and backward graphs AOTAutograd hands inductor for one compiled block of ``spec``
    (a preset or ``hf:PATH``, built as ``verify`` builds it, on meta then fake tensors), bf16 autocast:
    one each, unless dynamo breaks the block."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V
    from torch._subclasses import FakeTensorMode

    graphs: list[Graph] = []

    def keep(backward: bool) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs.append(Graph(backward, copy.deepcopy(gm), list(example_inputs)))
            return make_boxed_func(gm.forward)
        return compiler

    source = real_model(spec, seq_len=seq_len)
    data = source.make_batch(batch)
    with torch.device("meta"):
        built = source.build(batch, data)
    model = built.module

    def partition(joint: torch.fx.GraphModule, joint_inputs: list, **kwargs: object) -> tuple:
        # inductor's: its joint-graph passes (random operators replaced by seeded ones, no-op
        # conversions removed), then the min-cut partitioner; the passes read the fake mode
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return partition_fn(joint, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=keep(False), bw_compiler=keep(True),
                           partition_fn=partition, decompositions=select_decomp_table())
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in model.modules():
            for key, param in list(module.named_parameters(recurse=False)):
                setattr(module, key, torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype)))
            for key, buffer in list(module.named_buffers(recurse=False)):
                module._buffers[key] = torch.zeros(buffer.shape, dtype=buffer.dtype)
        # the first block alone, as the profile's first block kind is measured: blocks of other
        # shapes (ResNet's stages) would recompile with symbolic sizes
        model.get_submodule(next(iter(find_blocks(model).blocks))).compile(backend=backend, dynamic=False)
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = built.loss(model(*data.args, **data.kwargs), data.targets)
        loss.backward()
    return graphs


def _for_cuda(graph: Graph) -> Graph:
    """``graph`` with its inputs, the devices its operators name and its values' metadata on ``cuda:0``."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    cuda, module = torch.device("cuda", 0), copy.deepcopy(graph.module)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=cuda) if isinstance(x, torch.Tensor)
                  else x for x in graph.inputs]
    for node in module.graph.nodes:
        node.args = tuple(cuda if isinstance(arg, torch.device) else arg for arg in node.args)
        if isinstance(node.kwargs.get("device"), (torch.device, str)):
            node.kwargs = {**node.kwargs, "device": cuda}
    module.recompile()
    FakeTensorProp(module, mode).propagate_dont_convert_inputs(*inputs)
    return Graph(graph.backward, module, inputs)


def lower(graph: Graph) -> tuple[list[Launch], str | None]:
    """The kernels inductor launches for ``graph`` lowered for the faked H100, and None; where that
    fails, those it launches lowered for the CPU device, and why the CUDA lowering failed."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    modules: list[str] = []
    to_module = GraphLowering.compile_to_module

    def recorded(self):
        module = to_module(self)
        modules.append(module.__file__)
        return module

    GraphLowering.compile_to_module = recorded
    try:
        try:
            cuda = _for_cuda(graph)
            compile_fx_inner(cuda.module, cuda.inputs, is_backward=graph.backward)
            failed = None
        except Exception as error:  # noqa: BLE001 - reported on the line, then the CPU device's lowering
            modules.clear()
            failed = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            compile_fx_inner(copy.deepcopy(graph.module), graph.inputs, is_backward=graph.backward)
    finally:
        GraphLowering.compile_to_module = to_module
    return [launch for path in modules for launch in _launches(path, graph.backward)], failed


LAYOUT_COPY = re.compile(r"triton_poi_fused_convolution_\d+$")
"""A kernel that copies a convolution's output into the layout inductor chose, which a CPU-only
build of torch writes where a GPU's does not: its meta convolution cannot ask cuDNN for the
channels-last output a channels-last input gets (``cudnn_conv_suggest_memory_format``), so the
output comes out NCHW and is copied. Left out of the launches."""


def _launches(path: str, backward: bool) -> list[Launch]:
    """Every kernel the module at ``path`` launches in its ``call``, in order, but
    :data:`LAYOUT_COPY`'s. Launches of one source share its estimate, made for the first one's
    sizes: each is scaled to the elements it is launched for."""
    launches = []
    text = open(path).read()
    for line in text[text.rindex("def call("):].splitlines():
        line = line.strip()
        if (found := re.match(r"(triton_\w+)\.run\((.*), stream=", line)) and not LAYOUT_COPY.match(found.group(1)):
            num_bytes, loops = SOURCES[found.group(1)]
            # the loops' sizes are its last arguments (a seeded random kernel's seed offset is before them)
            sizes = re.findall(r"(?:^|, )(\d+)(?=,|$)", found.group(2))[-len(loops):]
            launches.append(Launch(backward, found.group(1), num_bytes * math.prod(map(int, sizes)) / math.prod(loops)))
        elif found := re.match(r"extern_kernels\.(\w+)\(", line):
            launches.append(Launch(backward, f"extern_kernels.{found.group(1)}", 0.0))
    return launches


def inductor_block(spec: str, batch: int, seq_len: int | None) -> tuple[list[Launch], list[str]]:
    """The launches of one compiled block of ``spec``, forward and backward (:func:`capture`,
    :func:`lower`), and what makes them other than one compiled block's: graphs lowered for the CPU
    device instead (and why), a direction captured as several graphs."""
    launches, notes = [], []
    graphs = capture(spec, batch, seq_len)
    for graph in graphs:
        kernels, failed = lower(graph)
        launches += kernels
        if failed:
            notes.append(f"{'backward' if graph.backward else 'forward'} lowered for the CPU device ({failed})")
    for backward, direction in ((False, "forward"), (True, "backward")):
        if (count := sum(graph.backward == backward for graph in graphs)) > 1:
            notes.append(f"{direction} captured as {count} graphs (dynamo broke the block): not one compiled block")
    return launches, notes


def _split(totals: dict[int, tuple[float, int]]) -> Split:
    (small, (a, kernels)), (large, (b, _)) = sorted(totals.items())
    per_sample = (b - a) / (large - small)
    return Split(per_sample, a - per_sample * small, kernels)


def main() -> None:
    cases = sys.argv[1:] or CASES
    profiles = {}
    for case in cases:  # before inductor's device is faked: the profile runs as it always does
        name, seq = case.rsplit(":", 1)
        profiles[case] = profile_spec(name, seq_len=None if seq == "-" else int(seq), precision="bf16-mixed")
    _fake_h100()
    print("per block, MB per sample + MB fixed (weights' casts) in kernels; the fusion model, then inductor's"
          " Triton kernels for an H100 (GEMMs and attention apart)")
    for case in cases:
        name, seq = case.rsplit(":", 1)
        started = time.perf_counter()
        block = profiles[case].blocks[0]
        runs, notes = {}, set()
        for batch in BATCHES:
            runs[batch], found = inductor_block(name, batch, None if seq == "-" else int(seq))
            notes.update(found)
        for backward, direction in ((False, "fwd"), (True, "bwd")):
            fused = getattr(block, f"{direction}_fused_op_bytes") / PROFILE_BATCH
            fixed = getattr(block, f"{direction}_param_op_bytes")
            triton = {batch: (sum(x.num_bytes for x in launches if x.backward == backward and x.kernel.startswith("triton")),
                              sum(x.backward == backward and x.kernel.startswith("triton") for x in launches))
                      for batch, launches in runs.items()}
            measured = _split(triton)
            kinds = collections.Counter()
            for launch in runs[BATCHES[-1]]:
                if launch.backward == backward and launch.kernel.startswith("triton"):
                    kinds[launch.kernel.split("_")[1]] += launch.num_bytes
            total = sum(kinds.values()) or 1
            print(f"{case:16} {direction}: model {fused / 1e6:7.1f} + {fixed / 1e6:6.1f} | inductor "
                  f"{measured.per_sample / 1e6:7.1f} + {measured.fixed / 1e6:6.1f} in {measured.kernels} Triton kernels "
                  f"({', '.join(f'{kind} {share / total:.0%}' for kind, share in sorted(kinds.items()))} of the bytes at "
                  f"batch {BATCHES[-1]}); per sample {fused / measured.per_sample - 1:+.0%}")
        for note in sorted(notes):
            print(f"{'':16} {note}")
        print(f"{'':16} ({time.perf_counter() - started:.0f} s)")
    print("poi: element-wise kernels; red: reductions looping over their rows; per: reductions held in registers")


if __name__ == "__main__":
    main()
