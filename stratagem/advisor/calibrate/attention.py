"""The attention benchmark ``stratagem calibrate`` runs on GPUs: scaled dot-product attention on
the kernel torch picks there, forward and backward apart, by sequence length, head width and
causality (:func:`attention_rates`). The cost model reads a fused attention call's rate off them
(:mod:`~stratagem.advisor.cost.attention`) in place of its tile model (docs/cost-model.md,
"Attention").

Rates are FLOPs as torch's counter counts them (the whole ``s × s``, causal or not) over seconds,
the forward's and the backward's apart, so that the cost model divides the profile's counts by them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.calibrate.benchmarks import BUDGET_SECONDS, TORCH_DTYPES, interleaved, repeated, sustained
from stratagem.advisor.profile.flop_formulas import CPU_ATTENTION_FLOPS

__all__ = ["ATTENTION_SEQUENCES", "ATTENTION_HEAD_WIDTHS", "attention_rates"]

ATTENTION_SEQUENCES = (128, 256, 512, 1024, 2048, 8192)
"""Sequence lengths timed: one attention tile to a long context. A factor of two apart up to 2,048,
where the rate bends: on an H100 it more than doubles from 128 to 512 tokens, and interpolated
from points a factor of four apart the curve priced ViT-L/16's 197 tokens at 10.8 ms where its
kernels took 6.3 (bench/gpu_predictions.py's last lines)."""

ATTENTION_HEAD_WIDTHS = (64, 128)
"""Head widths timed: GPT-2's, BERT's and ViT's 64; Llama's, Mistral's and Qwen's 128."""

ATTENTION_TOKENS = 32768
"""Query rows per timed call (batch × sequence), at ``ATTENTION_WIDTH`` over the heads."""

ATTENTION_WIDTH = 2048
"""Heads × head width of the timed calls."""

ATTENTION_SUSTAINED_SECONDS = 0.05
"""How long each timed run repeats a shape: a quarter of the matmuls' (sixteen shapes, two runs
each, took 12 s on an H100; the twenty-four now, about 18)."""

Point = tuple[int, bool, int, float, float]
"""``(head width, causal, sequence, forward FLOP/s, backward FLOP/s)``."""


def attention_rates(dtypes: Sequence[str], device: torch.device, *, repeats: int,
                    sequences: Sequence[int] = ATTENTION_SEQUENCES, widths: Sequence[int] = ATTENTION_HEAD_WIDTHS,
                    tokens: int = ATTENTION_TOKENS) -> dict[str, list[Point]]:
    """Per dtype, the rates of SDPA's forward and of its backward for each sequence length, head
    width and causality: ``tokens`` query rows per call, repeated for about
    :data:`ATTENTION_SUSTAINED_SECONDS` per timed run and timed
    :func:`~stratagem.advisor.calibrate.benchmarks.interleaved` (the backward's time: forward
    and backward less the forward). A shape whose single run would take over
    :data:`~stratagem.advisor.calibrate.benchmarks.BUDGET_SECONDS` (the slowest rank's) is skipped."""
    runs: list[Callable[[], object]] = []
    shapes: list[tuple[str, int, bool, int, int, int, int]] = []  # (dtype, d, causal, s, count, fwd, bwd FLOPs)
    for dtype in dtypes:
        for width in widths:
            for seq in sequences:
                for causal in (False, True):
                    forward, both, (fwd, bwd) = _attention_step(dtype, device, seq=seq, width=width, causal=causal,
                                                               tokens=tokens)
                    run_both, count, single = sustained(both, device, seconds=ATTENTION_SUSTAINED_SECONDS)
                    if single > BUDGET_SECONDS:
                        continue  # the same on every rank: ``single`` is the slowest rank's
                    runs += [repeated(forward, count), run_both]
                    shapes.append((dtype, width, causal, seq, count, fwd, bwd))
    seconds = interleaved(runs, device, repeats=repeats) if runs else []
    rates: dict[str, list[Point]] = {}
    for (dtype, width, causal, seq, count, fwd, bwd), forward, both in zip(shapes, seconds[::2], seconds[1::2]):
        backward = max(both - forward, forward * 1e-3)  # noise cannot make the backward free
        rates.setdefault(dtype, []).append((width, causal, seq, fwd * count / forward, bwd * count / backward))
    return {dtype: sorted(points) for dtype, points in rates.items()}


def _attention_step(dtype: str, device: torch.device, *, seq: int, width: int, causal: bool,
                    tokens: int) -> tuple[Callable[[], object], Callable[[], object], tuple[int, int]]:
    """SDPA's forward alone, its forward and backward, and the FLOPs torch's counter counts in
    each direction, for ``tokens // seq`` sequences of ``seq`` rows in ``dtype``."""
    batch, heads = max(1, tokens // seq), max(1, ATTENTION_WIDTH // width)
    q, k, v = (torch.randn(batch, heads, seq, width, device=device, dtype=TORCH_DTYPES[dtype], requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both() -> None:
        torch.autograd.grad(forward(), (q, k, v), grad)

    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:  # as the profile counts
        out = forward()
    fwd = counter.get_total_flops()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        torch.autograd.grad(out, (q, k, v), grad)
    return forward, both, (fwd, counter.get_total_flops())
