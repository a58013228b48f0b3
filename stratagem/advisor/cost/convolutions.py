"""Convolutions as cuDNN runs them: implicit GEMMs, and the layout transforms a model in torch's
default NCHW layout pays around each one on an NVIDIA GPU (docs/cost-model.md, "Rates").

cuDNN computes a convolution as an implicit GEMM (NVIDIA, *Convolutional Layers User's Guide*,
"Convolution Algorithms"): the forward multiplies an ``M×K`` matrix of input windows by a ``K×N``
one of filters, ``M = N·H_out·W_out`` output positions, ``N = C_out/groups``, ``K =
C_in/groups·kh·kw``, one GEMM per group. The window matrix is gathered on chip, not formed in
memory, so the GEMMs stream the input, the filters and the output once, not the ``M×K`` matrix
(``kh·kw`` times the input). The backward's data-gradient and weight-gradient GEMMs are the
forward's transposed, as a Linear's are: ``(M, K, N)`` and ``(K, N, M)``, the same FLOPs.

cuDNN's tensor-core kernels read NHWC: given NCHW tensors it transforms each convolution's
input to NHWC and its output back (NVIDIA, *Convolutional Layers User's Guide*, "Tensor Layouts
In Memory: NCHW vs NHWC"; cuDNN Developer Guide, "Tensor Transformations": "NCHW-to-NHWC
transformations to call the Tensor Core operations"), a copy that reads and writes the tensor.
The kernels show in profiles as ``nchwToNhwcKernel``/``nhwcToNchwKernel`` around every
convolution (instanseg/instanseg#144: 12 % of an NCHW model's CUDA time). A model moved to
``torch.channels_last`` runs cuDNN's NHWC kernels on its tensors as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.memo import by_identity
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import ConvLayer, SegmentProfile
from stratagem.plan import Plan
from stratagem.plan.precision import get_precision

# The compute dtypes whose convolutions cuDNN runs on tensor cores, with NHWC kernels.
TENSOR_CORE_DTYPES = ("bfloat16", "float16")


class ConvGemm(NamedTuple):
    """One implicit GEMM of a convolution, ``batch`` of them (one per group): ``m×k · k×n``,
    streaming ``moved`` elements from memory each."""

    m: float
    n: float
    k: float
    batch: float
    moved: float

    @property
    def size(self) -> float:
        """``m·n·k`` over every group: half the GEMMs' FLOPs."""
        return self.batch * self.m * self.n * self.k


def conv_gemms(conv: ConvLayer, batch_scale: float) -> Iterator[ConvGemm]:
    """The implicit GEMMs ``conv`` runs on a batch of ``batch_scale`` times the profiled one:
    forward ``(M, N, K)``, input gradient ``(M, K, N)`` where backward computes one, weight
    gradient ``(K, N, M)``. A depthwise convolution (one input channel per group) runs as one
    kernel over every channel (PyTorch's and cuDNN's depthwise kernels), not a GEMM per group:
    one ``M × C_out`` output reducing ``kh·kw`` window elements."""
    rows, source = conv.rows * batch_scale, conv.input_rows * batch_scale
    per_group_in = conv.in_channels / conv.groups
    depthwise = per_group_in == 1 and conv.groups > 1
    batch = 1 if depthwise else conv.groups
    n = conv.out_channels / batch
    k = per_group_in * conv.window
    moved = (source * conv.in_channels + conv.out_channels * per_group_in * conv.window
             + rows * conv.out_channels) / batch
    yield ConvGemm(rows, n, k, batch, moved)
    if conv.input_grad:
        yield ConvGemm(rows, k, n, batch, moved)
    yield ConvGemm(k, n, rows, batch, moved)


def forward_flops(conv: ConvLayer) -> float:
    """FLOPs of ``conv``'s forward at the profiled batch: ``2·M·N·K`` over its groups."""
    return 2 * next(conv_gemms(conv, 1.0)).size


def arithmetic_intensity(conv: ConvLayer, batch_scale: float, element_bytes: int) -> float:
    """FLOPs per byte ``conv``'s forward GEMMs do on what they stream from memory (its input,
    filters and output once): where it sits on the roofline (Williams et al. 2009). Its backward's
    GEMMs stream the same tensors for the same FLOPs."""
    forward = next(conv_gemms(conv, batch_scale))
    return 2 * forward.m * forward.n * forward.k / (forward.moved * element_bytes)


def pays_layout_transforms(cluster: Cluster, precision: str) -> bool:
    """Whether NCHW convolutions on ``cluster`` pay cuDNN's layout transforms: on NVIDIA GPUs with
    tensor cores (compute capability 7.0 on), in a 16-bit compute dtype (:data:`TENSOR_CORE_DTYPES`)."""
    device = cluster.device
    capable = device.compute_capability is None or tuple(device.compute_capability) >= (7, 0)
    return (device.is_gpu and device.vendor == "nvidia" and capable
            and get_precision(precision).compute_dtype in TENSOR_CORE_DTYPES)


def stage_layout_bytes(stage: Stage, plan: Plan, cluster: Cluster) -> dict[tuple[str, bool], float]:
    """Bytes the layout transforms of the stage's convolutions move on one TP rank at the profiled
    batch, keyed ``(direction, blocks only)``: the blocks' (compiled where the plan compiles them)
    divided over TP as their other work is, the embedding's and head's whole; nothing where
    :func:`pays_layout_transforms` says the rank pays none."""
    if not pays_layout_transforms(cluster, plan.precision):
        return {(direction, blocks_only): 0.0 for direction in ("fwd", "bwd") for blocks_only in (False, True)}
    element_bytes = get_precision(plan.precision).compute_bytes
    symbolic = symbolic_kinds(stage) if plan.compile else frozenset()
    blocks, outside = [0.0, 0.0], [0.0, 0.0]
    for block, count in stage.kinds:
        static = plan.compile and block.measurement not in symbolic
        for i, moved in enumerate(layout_transform_bytes(block, element_bytes=element_bytes, compiled=static)):
            blocks[i] += count * moved / plan.tp
    in_blocks = {id(block) for block in stage.blocks}
    for segment in stage.segments:
        if id(segment) not in in_blocks:
            for i, moved in enumerate(layout_transform_bytes(segment, element_bytes=element_bytes, compiled=False)):
                outside[i] += moved
    return {("fwd", True): blocks[0], ("bwd", True): blocks[1],
            ("fwd", False): blocks[0] + outside[0], ("bwd", False): blocks[1] + outside[1]}


@by_identity
def symbolic_kinds(stage: Stage) -> frozenset[str]:
    """The kinds of block (``SegmentProfile.measurement``) whose compiled graphs dynamo traces with
    symbolic shapes where the compile plugin compiles the stage's blocks one by one. They share a
    forward's code (``nn.Module._call_impl``), whose input sizes dynamo records at every
    compilation (torch 2.13's ``automatic_dynamic_shapes``): a kind compiles at its first block,
    and once an input dimension has taken a second value it is symbolic in every graph compiled
    after, unless a parameter's static shape pins it (a convolution's channels). The
    convolutions' inputs count here, their positions (``input_rows``, N·H·W) standing for the
    block input's: a ResNet's first stage and the second's first block compile static, every
    later bottleneck symbolic (docs/cost-model.md, "Compilation")."""
    positions: set[int] = set()
    compiled: set[str] = set()
    symbolic: set[str] = set()
    for block in stage.blocks:
        positions.update(conv.input_rows for conv in block.convs[:1])
        kind = block.measurement
        if kind not in compiled:
            compiled.add(kind)
            if len(positions) > 1:
                symbolic.add(kind)
    return frozenset(symbolic)


def layout_transform_bytes(segment: SegmentProfile, *, element_bytes: int, compiled: bool) -> tuple[float, float]:
    """Bytes the NCHW↔NHWC transforms around ``segment``'s NCHW convolutions read and write at the
    profiled batch, ``(forward, backward)``: each transform reads a tensor and writes it. Eager,
    every convolution transforms its input and its output; its backward the output's gradient and
    the input's for the data gradient, the input and the output's gradient for the weight's.
    ``compiled`` (a block under ``torch.compile`` traced with static shapes: :func:`symbolic_kinds`),
    where inductor runs the graph's convolutions channels-last (:func:`inductor_runs_channels_last`)
    and hands out the strides eager would (``keep_output_stride``): only the block's input and
    output are transformed, each way."""
    convs = [conv for conv in segment.convs if not conv.channels_last]
    if not convs:
        return 0.0, 0.0
    if compiled and inductor_runs_channels_last(segment.convs):
        boundary = 2.0 * (segment.input_bytes + segment.output_bytes)
        return boundary, boundary
    forward = backward = 0.0
    for conv in convs:
        source = conv.input_rows * conv.in_channels * element_bytes
        output = conv.rows * conv.out_channels * element_bytes
        forward += 2 * (source + output)
        backward += 2 * (source + output) * (2 if conv.input_grad else 1)
    return forward, backward


def inductor_runs_channels_last(convs: tuple[ConvLayer, ...]) -> bool:
    """Whether inductor lays a training graph holding ``convs`` out channels-last
    (``torch._inductor.config.layout_optimization``, on by default for CUDA; torch 2.13's
    ``GraphLowering.decide_layout_opt``): not with a grouped convolution of several input
    channels per group, nor one whose window is taller than 1 and whose output has at most half
    its input's channels, nor when every convolution has at most 64 channels in and out; nor in a
    graph of symbolic shapes (:func:`symbolic_kinds`), which the caller says."""
    grouped = any(conv.groups > 1 and conv.in_channels > conv.groups for conv in convs)
    narrowing = any(conv.out_channels * 2 <= conv.in_channels / conv.groups and conv.kernel[0] > 1 for conv in convs)
    small = all(conv.out_channels <= 64 and conv.in_channels / conv.groups <= 64 for conv in convs)
    return bool(convs) and not (grouped or narrowing or small)
