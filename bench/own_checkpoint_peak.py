"""The memory model against torch's own count for models that checkpoint their own blocks.

A model may run ``torch.utils.checkpoint`` on its blocks itself: around each block from the loop
that calls it (non-reentrant, or reentrant: torch's default where ``use_reentrant`` is not given),
inside the block's call (torch's ``checkpoint_wrapper``; a Hugging Face model after
``gradient_checkpointing_enable()``). The advisor then prices the plan the user runs, the model
as it is. Each case is built on fake tensors and trained for two steps as a GPU runs them
(``bench/fake_peak.py``'s ``cuda_step``: CUDA's attention kernel, autocast lists, fused RMSNorm and
dropout, AdamW on its ``foreach`` path), the second under ``MemTracker``; printed beside it, the
advisor's predicted peak for ``single`` at micro-batch = batch on one H100, without the framework's
bytes and the allocator's rounding.

    .venv/bin/python bench/own_checkpoint_peak.py      # about two minutes on 2 cores
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fake_peak import cuda_step, single_plan_peak, tracked_peak  # bench/fake_peak.py
from trainer_hf import SHAPES, next_token_loss  # bench/trainer_hf.py's Hugging Face shapes and training loss
from stratagem.advisor.profile.profiler import profile_model
from stratagem.models import Transformer, get_preset

GIB = 2**30
PRECISION = "bf16-mixed"
PRESET, BATCH, SEQ = "gpt2-medium", 4, 1024
HF_MODEL, HF_BATCH, HF_SEQ = "qwen2-0.5b", 2, 1024
PLACEMENTS = (None, "around", "reentrant", "wrapped")


class _Checkpointed(Transformer):
    """The preset's transformer, its blocks checkpointed around their calls by its own forward."""

    reentrant = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self._embed(tokens)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, None, use_reentrant=self.reentrant)
        return self.output(self.norm(h))


def preset_case(placement: str | None) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
    """``placement``: None (plain), ``around`` (non-reentrant), ``reentrant``, or ``wrapped``."""
    def build() -> tuple[nn.Module, torch.Tensor]:
        config = get_preset(PRESET).config
        model = _Checkpointed(config) if placement in ("around", "reentrant") else Transformer(config)
        if placement == "reentrant":
            model.reentrant = True
        if placement == "wrapped":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for index, layer in enumerate(model.layers):
                model.layers[index] = checkpoint_wrapper(layer)
        return model, torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return build


def hf_case(reentrant: bool | None) -> Callable[[], tuple[nn.Module, torch.Tensor]]:
    """The Hugging Face shape, after ``gradient_checkpointing_enable()`` (``reentrant`` given) or not."""
    def build() -> tuple[nn.Module, torch.Tensor]:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = dict(SHAPES[HF_MODEL])
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
        model.config.use_cache = False
        if reentrant is not None:
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        return model, torch.randint(0, model.config.vocab_size, (HF_BATCH, HF_SEQ))
    return build


def _loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The training step's loss of a preset's logits or a Hugging Face model's output."""
    return next_token_loss(getattr(output, "logits", output), tokens)


def predicted(build: Callable[[], tuple[nn.Module, torch.Tensor]]) -> float:
    model, tokens = build()
    profile = profile_model(model, (tokens,), loss_fn=lambda out: _loss(out, tokens), precision=PRECISION)
    return single_plan_peak(profile, tokens.size(0))


def measured(build: Callable[[], tuple[nn.Module, torch.Tensor]]) -> float:
    """MemTracker's peak bytes over the second of two training steps."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, tokens = build()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)

        def step() -> torch.Tensor:
            return _loss(model(tokens), tokens)

        return tracked_peak(model, optimizer, lambda: cuda_step(step, optimizer, autocast))


def main() -> None:
    started = time.perf_counter()
    cases = [(f"{PRESET} {placement or 'plain'}", preset_case(placement)) for placement in PLACEMENTS]
    if importlib.util.find_spec("transformers") is None:
        print(f"{HF_MODEL}: skipped, transformers is not installed (pip install 'stratagem[hf]')")
    else:
        cases += [(f"{HF_MODEL} {name}", hf_case(reentrant))
                  for name, reentrant in (("plain", None), ("hf-ckpt", False), ("hf-ckpt reentrant", True))]
    print(f"{'case':<30} {'predicted':>10} {'MemTracker':>10} {'error':>7}")
    for name, build in cases:
        ours, torchs = predicted(build), measured(build)
        print(f"{name:<30} {ours / GIB:>8.2f} G {torchs / GIB:>8.2f} G {ours / torchs - 1:>+7.1%}", flush=True)
    print(f"{PRECISION}; {PRESET} {BATCH} x {SEQ}, {HF_MODEL} {HF_BATCH} x {HF_SEQ}; single on one H100; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
