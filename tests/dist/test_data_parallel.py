"""Every pp = tp = 1 plan matches one process: DDP, ZeRO-1/2/3, HSDP, checkpointing, offload,
gradient accumulation and mixed precision, each trained on real gloo processes.

Spawning costs seconds, so one spawn trains every 2-rank plan and another every 4-rank plan
(session fixtures in ``conftest.py``, shared with the tensor-parallel tests); each test compares one plan's run with its single-process run
(see ``training.py``: the single process runs the same micro-batches and accumulates).

Tolerances, with what was observed on llama-tiny (no biases, untied embeddings):

* fp32 ``rtol=1e-5, atol=1e-6``. Most plans came out bit-equal: with two ranks, summing two
  gradients across ranks rounds as accumulating them in one process does. Not asserted bit-exact,
  since gloo's reduction order is not a contract; grad_accum (four micro-batches summed in a
  different grouping) differs by ~1e-7.
* gpt2-tiny (tied embeddings) fp32 ``atol=1e-5``: its key bias has a true gradient of zero
  (softmax ignores a constant added to every score), so the gradient there is pure rounding
  noise, which AdamW normalises into updates of ~1e-6 per step (observed 5.8e-6 after 5).
* bf16 autocast with DDP: fp32 tolerance: both runs do the same bf16 ops on the same
  micro-batches; only the fp32 gradient sum differs (observed bit-equal).
* bf16 ``MixedPrecisionPolicy`` (FSDP): losses ``rtol=2e-4`` (observed 3e-5); FSDP also casts
  the blocks' floating inputs (the rotary tables) to bf16, which the reference does not, so
  weights differ at bf16 resolution. Elementwise weight checks mean nothing there (AdamW moves
  no weight by more than ``lr × steps`` = 5e-3), so each parameter's *update* is compared:
  ``‖Δplan − Δref‖ / ‖Δref‖ ≤ 0.15`` (observed ≤ 0.064; bf16 against fp32 itself is ~0.04).
"""

from __future__ import annotations

import torch
from training import Case, Run, initial_weights, train_single

from stratagem.plan import Plan

FP32 = {"rtol": 1e-5, "atol": 1e-6}
TIED_FP32 = {"rtol": 1e-5, "atol": 1e-5}
MIXED_LOSS = {"rtol": 2e-4, "atol": 0.0}
MIXED_UPDATE = 0.15

_REPLICATE2 = {"dp_replicate": 2, "zero": 0, "micro_batch_size": 2, "precision": "fp32",
               "block_container": "layers"}
CLIP = 0.1
"""A global gradient norm the clipping cases' gradients exceed at every step (their norms are
about 1), so that every step is clipped."""
CLIP_VALUE = 0.005
"""A gradient value small enough that clipping by it changes what llama-tiny trains
(``test_gradients_clipped_by_value_match_single_process`` checks)."""
_SHARD2 = {"dp_shard": 2, "micro_batch_size": 2, "precision": "fp32", "block_container": "layers"}

TWO_RANKS = {case.name: case for case in [
    Case("ddp", Plan(**_REPLICATE2)),
    Case("zero1", Plan(zero=1, **_SHARD2)),
    Case("zero2", Plan(zero=2, **_SHARD2)),
    Case("zero3", Plan(zero=3, **_SHARD2)),
    Case("zero3_tied", Plan(zero=3, **_SHARD2), preset="gpt2-tiny"),
    Case("zero3_full_ckpt", Plan(zero=3, activation_checkpointing="full", **_SHARD2)),
    Case("ddp_selective_ckpt", Plan(activation_checkpointing="selective", **_REPLICATE2)),
    Case("zero3_selective_op_ckpt", Plan(zero=3, activation_checkpointing="selective-op", **_SHARD2)),
    Case("zero3_offload", Plan(zero=3, offload="params", **_SHARD2)),
    Case("zero3_accum", Plan(zero=3, grad_accum=2, **_SHARD2)),
    Case("zero3_accum_sgd", Plan(zero=3, grad_accum=2, **_SHARD2), optimizer="sgd"),
    Case("ddp_bf16", Plan(**{**_REPLICATE2, "precision": "bf16-mixed"}), reference="autocast-bf16"),
    Case("zero2_bf16", Plan(zero=2, **{**_SHARD2, "precision": "bf16-mixed"}), reference="bf16-params"),
    Case("ddp_clip", Plan(**_REPLICATE2), clip=CLIP),
]}
FOUR_RANKS = {case.name: case for case in [
    Case("hsdp", Plan(dp_replicate=2, zero=3, **_SHARD2)),
    Case("hsdp_sgd", Plan(dp_replicate=2, zero=3, **_SHARD2), optimizer="sgd"),
    Case("hsdp_clip", Plan(dp_replicate=2, zero=3, **_SHARD2), clip=CLIP),
]}


def assert_matches_single_process(case: Case, run: Run, tolerance: dict[str, float] = FP32) -> None:
    """``run`` (the plan's) and the single-process run of ``case`` agree step by step and at the
    end: losses, weights and data-parallel rank 0's buffers (``training.py``)."""
    reference = train_single(case)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses), **tolerance)
    torch.testing.assert_close(torch.tensor(run.facts.get("grad_norms", [])),
                               torch.tensor(reference.facts["grad_norms"]), **tolerance)
    for final, expected in ((run.weights, reference.weights), (run.buffers, reference.buffers)):
        assert final.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(final[name], tensor, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def test_gradients_clipped_by_the_global_norm_match_single_process(two_ranks, four_ranks):
    """``plugins.clip_grad_norm_`` takes the norm over every rank's part: DDP's copies once,
    HSDP's shards summed over the shard axis alone."""
    for run, name in ((two_ranks["ddp_clip"], "ddp_clip"), (four_ranks["hsdp_clip"], "hsdp_clip")):
        assert min(run.facts["grad_norms"]) > CLIP
        assert_matches_single_process({**TWO_RANKS, **FOUR_RANKS}[name], run)


def test_ddp_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["ddp"], two_ranks["ddp"])
    assert two_ranks["ddp"].facts["wrapper"] == "DistributedDataParallel"
    assert two_ranks["ddp"].facts["optimizer"] == "AdamW"


def test_zero1_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero1"], two_ranks["zero1"])
    assert two_ranks["zero1"].facts["optimizer"] == "ZeroRedundancyOptimizer"


def test_zero2_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero2"], two_ranks["zero2"])
    assert two_ranks["zero2"].facts["sharded_between_forward_and_backward"] is False  # gathered once per step


def test_zero3_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3"], two_ranks["zero3"])
    assert two_ranks["zero3"].facts["sharded_between_forward_and_backward"] is True  # resharded after forward


def test_zero3_tied_embeddings_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3_tied"], two_ranks["zero3_tied"], TIED_FP32)


def test_hsdp_matches_single_process(four_ranks):
    assert_matches_single_process(FOUR_RANKS["hsdp"], four_ranks["hsdp"])
    assert_matches_single_process(FOUR_RANKS["hsdp_sgd"], four_ranks["hsdp_sgd"])


def test_zero3_full_checkpointing_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3_full_ckpt"], two_ranks["zero3_full_ckpt"])


def test_ddp_selective_checkpointing_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["ddp_selective_ckpt"], two_ranks["ddp_selective_ckpt"])


def test_zero3_selective_op_checkpointing_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3_selective_op_ckpt"], two_ranks["zero3_selective_op_ckpt"])


def test_zero3_offload_params_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3_offload"], two_ranks["zero3_offload"])


def test_zero3_grad_accum_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["zero3_accum"], two_ranks["zero3_accum"])
    assert_matches_single_process(TWO_RANKS["zero3_accum_sgd"], two_ranks["zero3_accum_sgd"])


def test_ddp_bf16_autocast_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["ddp_bf16"], two_ranks["ddp_bf16"])
    assert two_ranks["ddp_bf16"].facts["output_dtype"] == torch.bfloat16


def test_zero2_bf16_mixed_precision_matches_single_process(two_ranks):
    case, run = TWO_RANKS["zero2_bf16"], two_ranks["zero2_bf16"]
    reference = train_single(case)
    assert run.facts["output_dtype"] == torch.bfloat16
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses), **MIXED_LOSS)
    start = initial_weights(case)
    for name, weight in reference.weights.items():
        update, expected = run.weights[name] - start[name], weight - start[name]
        assert (update - expected).norm() <= MIXED_UPDATE * expected.norm(), name
