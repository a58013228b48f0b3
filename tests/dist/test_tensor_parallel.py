"""Tensor-parallel plans match one process: TP, TP + sequence parallel, and TP × FSDP (with and
without full checkpointing), each trained on real gloo processes from the Plan's ``tp_layout``.

The layouts are written out here as the advisor would produce them for the reference presets
(llama-tiny: 4 heads, 2 key/value heads, ffn 176, so tp = 2 splits whole heads).

Tolerance: fp32 ``rtol=1e-5, atol=1e-4``. Losses agree to ~1e-7. TP changes the order of the
sums inside the split matmuls (partial products added by an all-reduce or reduce-scatter), so
no run is bit-equal, and a weight whose true gradient is nearly zero (first-step gradients of
2e-8 and 3e-9, at AdamW's eps) gets rounding noise that AdamW normalises into a visible update:
about one element per plan moved by up to 3.1e-5 (observed, 5 steps), every other within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from test_data_parallel import assert_matches_single_process
from training import Case

from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.models import get_preset
from stratagem.plugins import apply_plan
from stratagem.plugins.tensor_parallel import match_tp_layout

LLAMA_LAYOUT = (
    ("layers.*.attention.wq", "colwise"),
    ("layers.*.attention.wk", "colwise"),
    ("layers.*.attention.wv", "colwise"),
    ("layers.*.attention.wo", "rowwise"),
    ("layers.*.feed_forward.w1", "colwise"),
    ("layers.*.feed_forward.w3", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    ("layers.*.attention_norm", "sequence_parallel"),
    ("layers.*.ffn_norm", "sequence_parallel"),
)
GPT2_LAYOUT = (
    *LLAMA_LAYOUT[:4],
    ("layers.*.feed_forward.w1", "colwise"),
    ("layers.*.feed_forward.w2", "rowwise"),
    *LLAMA_LAYOUT[-2:],
)

TP_FP32 = {"rtol": 1e-5, "atol": 1e-4}

_TP2 = {"tp": 2, "micro_batch_size": 2, "precision": "fp32", "block_container": "layers",
        "tp_layout": LLAMA_LAYOUT}

TWO_RANKS = {case.name: case for case in [
    Case("tp", Plan(**_TP2)),
    Case("tp_sp", Plan(sequence_parallel=True, **_TP2)),
]}
FOUR_RANKS = {case.name: case for case in [
    Case("tp_fsdp", Plan(dp_shard=2, zero=3, **_TP2)),
    Case("tp_fsdp_full_ckpt", Plan(dp_shard=2, zero=3, activation_checkpointing="full", **_TP2)),
]}


def test_tp_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["tp"], two_ranks["tp"], TP_FP32)
    assert two_ranks["tp"].facts["wrapper"] == "Transformer"  # no DDP over a data-parallel degree of 1


def test_tp_sequence_parallel_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["tp_sp"], two_ranks["tp_sp"], TP_FP32)


def test_tp_fsdp_matches_single_process(four_ranks):
    assert_matches_single_process(FOUR_RANKS["tp_fsdp"], four_ranks["tp_fsdp"], TP_FP32)
    assert four_ranks["tp_fsdp"].facts["sharded_between_forward_and_backward"] is True


def test_tp_fsdp_full_checkpointing_matches_single_process(four_ranks):
    assert_matches_single_process(FOUR_RANKS["tp_fsdp_full_ckpt"], four_ranks["tp_fsdp_full_ckpt"], TP_FP32)


def tiny_model(preset: str = "llama-tiny") -> torch.nn.Module:
    torch.manual_seed(0)
    return get_preset(preset).build()


@pytest.mark.parametrize(("preset", "layout", "count"), [
    ("llama-tiny", LLAMA_LAYOUT, 9 * 4),
    ("gpt2-tiny", GPT2_LAYOUT, 8 * 2),
])
def test_layout_matches_every_block(preset, layout, count):
    plan = Plan(**{**_TP2, "tp_layout": layout})
    styles = match_tp_layout(tiny_model(preset), plan)
    assert len(styles) == count
    assert styles["layers.1.attention.wo"] == "rowwise" and styles["layers.1.ffn_norm"] == "sequence_parallel"


@pytest.mark.parametrize(("changes", "message"), [
    ({"tp_layout": ()}, "empty tp_layout"),
    ({"dp_replicate": 2}, "DDP .* does not compose with tensor parallelism"),
    ({"dp_shard": 2, "zero": 1}, "DDP .* does not compose with tensor parallelism"),
])
def test_apply_plan_refuses_tp_it_cannot_apply(changes, message):
    with pytest.raises(UsageError, match=message) as error:
        apply_plan(tiny_model(), Plan(**{**_TP2, **changes}), None)  # refused before the mesh is read
    assert "HINT:" in str(error.value)


@pytest.mark.parametrize(("pair", "message"), [
    (("layers.*.attention.wqkv", "colwise"), "matches no module(?s:.*)HINT:.*layers.0.attention.wq"),
    (("output", "colwise"), "outside the blocks"),
    (("layers.*.attention", "colwise"), "needs a Linear, but it is a Attention"),
    (("layers.*.attention.wq", "sequence_parallel"), "needs a LayerNorm or RMSNorm"),
])
def test_layout_that_does_not_fit_the_model_is_refused(pair, message):
    plan = Plan(**{**_TP2, "tp_layout": (*LLAMA_LAYOUT, pair)})
    with pytest.raises(UsageError, match=message):
        match_tp_layout(tiny_model(), plan)


def test_width_tp_does_not_divide_is_refused():
    plan = Plan(**{**_TP2, "tp": 3})
    with pytest.raises(UsageError, match=r"tp=3 does not divide layers.0.attention.wq.out_features \(64\)"):
        match_tp_layout(tiny_model(), plan)
