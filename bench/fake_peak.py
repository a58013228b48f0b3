"""The memory model against torch's own count: the peak that ``MemTracker`` sees on fake tensors.

For one-device plans, with no GPU: each case's model is built on fake tensors and trained for
two steps (forward, the loss, backward, AdamW on its ``foreach`` path as on GPUs, ``zero_grad``) under
``torch.distributed._tools.mem_tracker.MemTracker``, which follows every tensor's storage. The
attention kernel and autocast's float32 list are CUDA's, as on the GPU the plan is for
(:mod:`stratagem.advisor.profile.attention`, :mod:`stratagem.advisor.profile.autocast`: the
kernel choice only; the bytes are torch's), ``torch.rms_norm`` keeps what CUDA's fused kernel
keeps (:class:`CudaRmsNorm`) and dropout a one-byte mask, as CUDA's does (:class:`CudaDropout`). Printed beside it: the advisor's predicted peak for
the same plan, without the framework's bytes and the allocator's rounding (no GPU, so neither
exists here).

    .venv/bin/python bench/fake_peak.py            # about two and a half minutes on 2 cores
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.overrides import TorchFunctionMode

from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.attention import CudaAttention, unpacked_sequences
from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan import Workload
from stratagem.plan.precision import get_precision, torch_dtype

GIB = 2**30

from plans import given_plan  # bench/plans.py
from trainer_hf import SHAPES, next_token_loss  # bench/trainer_hf.py's HF shapes, trained as it trains them


class Case(NamedTuple):
    model: str  # a preset, a key of SHAPES or a folder of bench/configs (Hugging Face configs)
    batch: int
    seq_len: int | None
    precision: str


CASES = (
    Case("qwen2-0.5b", 4, 1024, "fp32"),
    Case("llama-1b", 4, 1024, "bf16-mixed"),
    Case("gpt2-medium", 8, 1024, "bf16-mixed"),
    Case("llama-small", 8, 512, "bf16-mixed"),
    Case("vit-small", 64, None, "bf16-mixed"),
    # gpu_check.sh's cases never tuned on, as its verify runs them
    Case("opt-1.3b", 8, 1024, "bf16-mixed"),
    Case("bloom-560m", 8, 1024, "bf16-mixed"),
    Case("qwen2.5-1.5b", 4, 1024, "bf16-mixed"),
)
CONFIGS = Path(__file__).parent / "configs"


def _hf_config(model: str) -> dict | None:
    """The Hugging Face config of ``model``: a key of SHAPES, or a folder of bench/configs."""
    if model in SHAPES:
        return dict(SHAPES[model])
    path = CONFIGS / model / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


class _FusedRmsNorm(torch.autograd.Function):
    """CUDA's ``aten._fused_rms_norm`` as autograd keeps it (``stratagem.advisor.profile.fused``):
    the input and each row's reciprocal RMS in fp32 saved, the normalisation's intermediates not.
    On CPU tensors, fake ones included, ``torch.rms_norm`` decomposes and saves them."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor | None, dims: tuple[int, ...], eps: float):
        rstd = torch.rsqrt(input.float().pow(2).mean(dims, keepdim=True) + eps)
        out = (input * rstd).to(input.dtype)
        ctx.save_for_backward(input, weight, rstd)
        ctx.dims = dims
        return out * weight if weight is not None else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        input, weight, rstd = ctx.saved_tensors
        normed = input * rstd
        scaled = grad * weight if weight is not None else grad
        grad_input = rstd * (scaled - normed * (scaled * normed).mean(ctx.dims, keepdim=True))
        rows = tuple(range(grad.dim() - len(ctx.dims)))
        grad_weight = (grad * normed).sum(rows) if weight is not None else None
        return grad_input.to(input.dtype), grad_weight, None, None


def _rms_norm_arguments(input, normalized_shape, weight=None, eps=None) -> tuple:
    return input, normalized_shape, weight, eps


class CudaRmsNorm(TorchFunctionMode):
    """While active, ``torch.rms_norm`` runs as CUDA's fused kernel does where its input and weight
    share a dtype (PyTorch PR #153666), so that MemTracker sees what the GPU keeps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.rms_norm, torch.rms_norm):
            return func(*args, **kwargs)
        input, shape, weight, eps = _rms_norm_arguments(*args, **kwargs)
        if weight is not None and weight.dtype != input.dtype:
            return func(*args, **kwargs)
        dims = tuple(range(-len(shape) if isinstance(shape, (list, tuple)) else -1, 0))
        return _FusedRmsNorm.apply(input, weight, dims, torch.finfo(input.dtype).eps if eps is None else eps)


class CudaDropout(TorchFunctionMode):
    """While active, ``F.dropout`` in training runs CUDA's fused ``native_dropout``, which saves a
    bool mask (one byte an element) where CPU tensors' decomposition saves it in the input's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.dropout:
            return func(*args, **kwargs)
        input, p, training, inplace = _dropout_arguments(*args, **kwargs)
        if not training or p == 0 or inplace:
            return func(*args, **kwargs)
        return torch.native_dropout(input, p, True)[0]


def _dropout_arguments(input, p=0.5, training=True, inplace=False) -> tuple:
    return input, p, training, inplace


def model_spec(case: Case, folder: Path) -> str:
    config = _hf_config(case.model)
    if config is None:
        return case.model
    path = folder / f"{case.model}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def predicted(case: Case, folder: Path) -> float:
    """The advisor's peak bytes for ``single mb=batch`` on one H100, without framework bytes."""
    profile = profile_spec(model_spec(case, folder), seq_len=case.seq_len, precision=case.precision)
    return single_plan_peak(profile, case.batch)


def single_plan_peak(profile: ModelProfile, batch: int) -> float:
    """The advisor's peak bytes for ``single mb=batch`` on one H100, at the profile's sequence and
    precision, without the framework's bytes (none on the catalog's figures) and the allocator's rounding."""
    cluster = parse_cluster("1xH100-SXM-80GB")
    workload = Workload(global_batch_size=batch, seq_len=profile.seq_len, precision=profile.precision)
    plan = given_plan({"micro_batch_size": batch}, profile, cluster, workload)
    memory = evaluate(profile, cluster, workload, plan).memory
    return memory.total - memory.framework


def model_and_step(case: Case, *, labels: bool = False):
    """The model, and one step's loss from it, built inside the active FakeTensorMode. A Hugging
    Face model's loss is computed from its logits, as bench/trainer_hf.py's training step does, or
    with ``labels`` by the model itself, as ``verify`` runs an ``hf:`` model."""
    config = _hf_config(case.model)
    if config is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config.pop("architectures", None)
        # transformers' default attention: SDPA where the architecture takes it (BLOOM's ALiBi does not)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
        tokens = torch.randint(0, model.config.vocab_size, (case.batch, case.seq_len))

        def step() -> torch.Tensor:  # bench/trainer_hf.py's training_step
            if labels:
                return model(input_ids=tokens, labels=tokens).loss
            return next_token_loss(model(input_ids=tokens).logits, tokens)

        return model, step
    from stratagem.models import get_preset

    preset = get_preset(case.model)
    model = preset.build()
    (inputs,), targets = preset.make_batch(case.batch, seq_len=case.seq_len)
    return model, lambda: preset.loss(model(inputs), targets)


def measured(case: Case) -> float:
    """MemTracker's peak bytes over the second of two training steps."""
    precision = get_precision(case.precision)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, step = model_and_step(case)  # parameters in fp32: the cases' precisions keep them so
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # as on GPUs
        autocast = torch.autocast("cpu", dtype=torch_dtype(precision.compute_dtype), enabled=precision.autocast)
        return tracked_peak(model, optimizer, lambda: cuda_step(step, optimizer, autocast))


def tracked_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_step: Callable[[], None]) -> float:
    """MemTracker's peak bytes over the second of two calls of ``train_step`` (the first makes the
    optimizer's states), inside the active FakeTensorMode."""
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for index in range(2):
            train_step()
            if index == 0:
                tracker.reset_mod_stats()
    return max(device["Total"] for device in tracker.get_tracker_snapshot("peak").values())


def cuda_step(step: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
              autocast: AbstractContextManager, *, accumulate: int = 1) -> None:
    """One training step (``step()``: the loss, of each of ``accumulate`` micro-batches) as a GPU
    runs it, CUDA's kernels standing in, the gradients dropped after."""
    with CudaAttention(), CudaRmsNorm(), CudaDropout(), CudaAutocast(), unpacked_sequences():
        for _ in range(accumulate):
            with autocast:
                loss = step()
            _backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the stand-ins above still active in it: a torch function mode is
    off while it handles a call, so ``Tensor.backward`` would run every checkpointed block's
    recompute without them (then recomputing what the CPU's kernels save, which checkpointing
    refuses as different from what the forward saved). The engine's own entry takes no detour."""
    torch.autograd.graph._engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                              allow_unreachable=True, accumulate_grad=True)


def adamw_step_bytes_per_parameter() -> float:
    """MemTracker's peak over parameters for a model whose activations are negligible (eight
    4096² Linears, one sample): the states and the foreach AdamW step's temporaries."""
    with FakeTensorMode():
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)))
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

        def train_step() -> None:
            model(torch.randn(1, 4096)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return tracked_peak(model, optimizer, train_step) / sum(p.numel() for p in model.parameters())


def main() -> None:
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp())
    print(f"{'model':<12} {'batch':>5} {'seq':>5} {'precision':<10} {'predicted':>10} {'MemTracker':>10} {'error':>6}")
    for case in CASES:
        if _hf_config(case.model) is not None and importlib.util.find_spec("transformers") is None:
            print(f"{case.model:<12} skipped: transformers is not installed (pip install 'stratagem[hf]')")
            continue
        ours, torchs = predicted(case, folder), measured(case)
        print(f"{case.model:<12} {case.batch:>5} {case.seq_len or '-':>5} {case.precision:<10} "
              f"{ours / GIB:>8.2f} G {torchs / GIB:>8.2f} G {ours / torchs - 1:>+6.1%}", flush=True)
    print(f"foreach AdamW step, fp32: {adamw_step_bytes_per_parameter():.1f} bytes per parameter at the peak "
          "(weights, gradients and two states: 16)")
    print(f"one H100 plan each (single, micro-batch = batch); {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
