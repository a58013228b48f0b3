"""Tensor-parallel plans match one process: TP, TP + sequence parallel, and TP × FSDP (with and
without full checkpointing, and with sequence parallelism), each trained on real gloo processes
from the Plan's ``tp_layout``; each also with the vocabulary split (the input embedding and the
output head), on llama-tiny (untied) and on a GPT-2 whose tied embedding and head hold 257
tokens, which two ranks split unevenly (129 and 128 rows).

The layouts are written out here as the advisor would produce them for the reference presets
(llama-tiny: 4 heads, 2 key/value heads, ffn 176, so tp = 2 splits whole heads).

Tolerance: fp32 ``rtol=1e-5, atol=1e-4``. Losses agree to ~1e-7. TP changes the order of the
sums inside the split matmuls (partial products added by an all-reduce or reduce-scatter), so
no run is bit-equal, and a weight whose true gradient is nearly zero (first-step gradients of
2e-8 and 3e-9, at AdamW's eps) gets rounding noise that AdamW normalises into a visible update:
about one element per plan moved by up to 3.1e-5 (observed, 5 steps), every other within 1e-6.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate
from spawn import run_on_ranks
from test_data_parallel import CLIP, CLIP_VALUE, assert_matches_single_process
from training import Case, global_batches, train_single

from stratagem.advisor.profile.profiler import profile_model
from stratagem.plan import Plan
from stratagem.errors import UsageError
from stratagem.models import Preset, Transformer, get_preset
from stratagem.plugins import apply_plan, build_mesh, build_optimizer
from stratagem.plugins.state_dict import (
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)
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

MIXTRAL_LAYOUT = (
    *LLAMA_LAYOUT[:4],
    *((f"layers.*.feed_forward.experts.*.{name}", style) for name, style in
      (("w1", "colwise"), ("w3", "colwise"), ("w2", "rowwise"))),
    *LLAMA_LAYOUT[-2:],
)

VOCAB = (("tok_embeddings", "vocab_embedding"), ("output", "vocab_head"))
VOCAB_LOSS = (("tok_embeddings", "vocab_embedding"), ("output", "vocab_loss"))

TP_FP32 = {"rtol": 1e-5, "atol": 1e-4}

_TP2 = {"tp": 2, "micro_batch_size": 2, "precision": "fp32", "block_container": "layers",
        "tp_layout": LLAMA_LAYOUT}
_VOCAB = {**_TP2, "tp_layout": (*LLAMA_LAYOUT, *VOCAB)}
_GPT2_VOCAB = {**_TP2, "tp_layout": (*GPT2_LAYOUT, *VOCAB)}
_VOCAB_LOSS = {**_TP2, "tp_layout": (*LLAMA_LAYOUT, *VOCAB_LOSS)}


def _gpt2_tied_257():
    """gpt2-tiny with 257 tokens: a tied embedding and head that two ranks split unevenly."""
    preset = get_preset("gpt2-tiny")
    config = dataclasses.replace(preset.config, vocab_size=257)
    return dataclasses.replace(preset, name="gpt2-tiny-257", config=config, vocab_size=257,
                               build=partial(Transformer, config))


GPT2_TIED_257 = _gpt2_tied_257()


def _hf_llama_logits() -> torch.nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` (its own ``LlamaRMSNorm``, rotary tables passed to each
    layer by keyword) whose forward returns the logits, as the preset's loss reads them."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    model.register_forward_hook(lambda _, __, output: output.logits)
    return model


HF_LLAMA = dataclasses.replace(get_preset("llama-tiny"), name="hf-llama", vocab_size=128, config=None,
                               build=_hf_llama_logits)
HF_LAYOUT = (*((f"model.layers.*.self_attn.{p}", s) for p, s in (("q_proj", "colwise"), ("k_proj", "colwise"),
                                                                  ("v_proj", "colwise"), ("o_proj", "rowwise"))),
             *((f"model.layers.*.mlp.{p}", s) for p, s in (("gate_proj", "colwise"), ("up_proj", "colwise"),
                                                            ("down_proj", "rowwise"))),
             ("model.layers.*.input_layernorm", "sequence_parallel"),
             ("model.layers.*.post_attention_layernorm", "sequence_parallel"),
             ("model.embed_tokens", "vocab_embedding"), ("lm_head", "vocab_head"))


def _case(name: str, plan: Plan, **options: Any) -> Case:
    """A TP case, stepped on the multi-tensor path torch.optim takes on GPUs."""
    return Case(name, plan, optimizer="adamw-foreach", **options)


TWO_RANKS = {case.name: case for case in [
    _case("tp", Plan(**_TP2)),
    _case("tp_sp", Plan(sequence_parallel=True, **_TP2)),
    _case("tp_vocab", Plan(**_VOCAB)),
    _case("tp_sp_vocab", Plan(sequence_parallel=True, **_VOCAB)),
    _case("tp_vocab_tied", Plan(**_GPT2_VOCAB), preset=GPT2_TIED_257),
    _case("tp_sp_vocab_tied", Plan(sequence_parallel=True, **_GPT2_VOCAB), preset=GPT2_TIED_257),
    _case("tp_sp_vocab_hf", Plan(**{**_TP2, "sequence_parallel": True, "block_container": "model.layers",
                                    "tp_layout": HF_LAYOUT}), preset=HF_LLAMA),
    _case("tp_sp_vocab_clip", Plan(sequence_parallel=True, **_VOCAB), clip=CLIP),
    _case("tp_sp_vocab_clip_value", Plan(sequence_parallel=True, **_VOCAB), clip=CLIP_VALUE, clip_by="value"),
    _case("tp_sp_vocab_loss", Plan(sequence_parallel=True, **_VOCAB_LOSS)),
    _case("tp_vocab_loss_tied", Plan(**{**_GPT2_VOCAB, "tp_layout": (*GPT2_LAYOUT, *VOCAB_LOSS)}),
          preset=GPT2_TIED_257),
]}
FOUR_RANKS = {case.name: case for case in [
    _case("tp_fsdp", Plan(dp_shard=2, zero=3, **_TP2)),
    _case("tp_fsdp_full_ckpt", Plan(dp_shard=2, zero=3, activation_checkpointing="full", **_TP2)),
    _case("tp_sp_fsdp", Plan(dp_shard=2, zero=3, sequence_parallel=True, **_TP2)),
    _case("tp_fsdp_vocab", Plan(dp_shard=2, zero=3, **_VOCAB)),
    _case("tp_fsdp_vocab_tied", Plan(dp_shard=2, zero=3, **_GPT2_VOCAB), preset=GPT2_TIED_257),
    _case("tp_fsdp_clip", Plan(dp_shard=2, zero=3, **_VOCAB), clip=CLIP),
    _case("tp_fsdp_vocab_loss", Plan(dp_shard=2, zero=3, grad_accum=2, **_VOCAB_LOSS)),
]}


def test_gradients_clipped_by_the_global_norm_match_single_process(two_ranks, four_ranks):
    """torch's ``clip_grad_norm_`` fails on these ranks (their DTensor and plain gradients cannot
    meet); ``plugins.clip_grad_norm_`` sums the split Linears' and vocabulary's shares, counts the
    norms' copies once and reduces SP's unreduced norm gradients first, on 1-D and 2-D meshes."""
    for run, case in ((two_ranks["tp_sp_vocab_clip"], TWO_RANKS["tp_sp_vocab_clip"]),
                      (four_ranks["tp_fsdp_clip"], FOUR_RANKS["tp_fsdp_clip"])):
        assert min(run.facts["grad_norms"]) > CLIP
        assert_matches_single_process(case, run, TP_FP32)


def test_gradients_clipped_by_value_match_single_process(two_ranks):
    """``plugins.clip_grad_value_`` clamps each rank's part, SP's unreduced norm gradients summed
    first (clamping a partial sum is not clamping the sum)."""
    case = TWO_RANKS["tp_sp_vocab_clip_value"]
    assert_matches_single_process(case, two_ranks["tp_sp_vocab_clip_value"], TP_FP32)
    unclipped = train_single(dataclasses.replace(case, clip=None))
    clipped = two_ranks["tp_sp_vocab_clip_value"].weights
    assert any(not torch.allclose(clipped[name], weight) for name, weight in unclipped.weights.items())


def test_tp_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["tp"], two_ranks["tp"], TP_FP32)
    assert two_ranks["tp"].facts["wrapper"] == "Transformer"  # no DDP over a data-parallel degree of 1


def test_tp_sequence_parallel_matches_single_process(two_ranks):
    assert_matches_single_process(TWO_RANKS["tp_sp"], two_ranks["tp_sp"], TP_FP32)


def test_tp_fsdp_matches_single_process(four_ranks):
    assert_matches_single_process(FOUR_RANKS["tp_fsdp"], four_ranks["tp_fsdp"], TP_FP32)
    assert four_ranks["tp_fsdp"].facts["sharded_between_forward_and_backward"] is True


def test_tp_sequence_parallel_fsdp_matches_single_process(four_ranks):
    """FSDP reduces the sequence-parallel norms' Partial gradients itself (no step hook)."""
    assert_matches_single_process(FOUR_RANKS["tp_sp_fsdp"], four_ranks["tp_sp_fsdp"], TP_FP32)


def test_tp_fsdp_full_checkpointing_matches_single_process(four_ranks):
    assert_matches_single_process(FOUR_RANKS["tp_fsdp_full_ckpt"], four_ranks["tp_fsdp_full_ckpt"], TP_FP32)


@pytest.mark.parametrize(("name", "rows", "tied"), [
    ("tp_vocab", 128, False), ("tp_sp_vocab", 128, False), ("tp_vocab_tied", 129, True), ("tp_sp_vocab_tied", 129, True),
])
def test_vocabulary_split_matches_single_process(two_ranks, name, rows, tied):
    assert_matches_single_process(TWO_RANKS[name], two_ranks[name], TP_FP32)
    assert two_ranks[name].facts["embedding_rows"] == rows  # rank 0's share of the vocabulary
    assert two_ranks[name].facts["tied"] is tied


def test_a_hugging_face_llama_splits_as_the_advisor_lays_it_out_and_matches_single_process(two_ranks):
    """The layout the profile finds for a Hugging Face Llama (its own norm class on sequence
    shards, its decoder layers called with keyword arguments), vocabulary split too."""
    case = TWO_RANKS["tp_sp_vocab_hf"]
    model = case.model
    profile = profile_model(model.build(), model.make_batch(2, 16)[0], precision="fp32", kernels="cpu")
    assert set(profile.tp_layout) == set(HF_LAYOUT)
    assert_matches_single_process(case, two_ranks["tp_sp_vocab_hf"], TP_FP32)


@pytest.mark.parametrize("name", ["tp_fsdp_vocab", "tp_fsdp_vocab_tied"])
def test_vocabulary_split_under_fsdp_matches_single_process(four_ranks, name):
    assert_matches_single_process(FOUR_RANKS[name], four_ranks[name], TP_FP32)


@pytest.mark.parametrize(("name", "ranks"), [("tp_sp_vocab_loss", 2), ("tp_vocab_loss_tied", 2),
                                             ("tp_fsdp_vocab_loss", 4)])
def test_a_loss_on_the_logits_vocabulary_shards_matches_single_process(two_ranks, four_ranks, name, ranks):
    """``vocab_loss``: the head's logits stay a DTensor on vocabulary shards, and the preset's
    cross-entropy runs on them under ``vocab_parallel_loss`` (torch's ``loss_parallel``): with
    sequence parallelism, a tied embedding split unevenly (257 tokens), and under FSDP with
    accumulation; losses and weights as one process trains them."""
    case, run = (TWO_RANKS[name], two_ranks[name]) if ranks == 2 else (FOUR_RANKS[name], four_ranks[name])
    assert run.facts["logits_on_shards"] is True
    assert_matches_single_process(case, run, TP_FP32)


def tiny_model(preset: str = "llama-tiny") -> torch.nn.Module:
    torch.manual_seed(0)
    return get_preset(preset).build()


@pytest.mark.parametrize(("preset", "layout", "count"), [
    ("llama-tiny", LLAMA_LAYOUT, 9 * 4),
    ("gpt2-tiny", GPT2_LAYOUT, 8 * 2),
    ("gpt2-tiny", (*GPT2_LAYOUT, *VOCAB), 8 * 2 + 2),
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
    (("layers.*.attention.wq", "vocab_head"), "inside the blocks"),
    (("output", "vocab_embedding"), "needs an Embedding, but it is a Linear"),
])
def test_layout_that_does_not_fit_the_model_is_refused(pair, message):
    plan = Plan(**{**_TP2, "tp_layout": (*LLAMA_LAYOUT, pair)})
    with pytest.raises(UsageError, match=message):
        match_tp_layout(tiny_model(), plan)


def test_width_tp_does_not_divide_is_refused():
    plan = Plan(**{**_TP2, "tp": 3})
    with pytest.raises(UsageError, match=r"tp=3 does not divide layers.0.attention.wq.out_features \(64\)"):
        match_tp_layout(tiny_model(), plan)


def test_tied_weight_split_one_way_only_is_refused():
    plan = Plan(**{**_TP2, "tp_layout": (*GPT2_LAYOUT, ("output", "vocab_head"))})
    with pytest.raises(UsageError, match=r"'tok_embeddings', 'output' share one weight(?s:.*)HINT"):
        match_tp_layout(tiny_model("gpt2-tiny"), plan)


def _trained(preset: Preset, plan: Plan, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``preset`` built with ``seed`` under ``plan``, after one AdamW step (so it has states)."""
    torch.manual_seed(seed)
    model = apply_plan(preset.build(), plan, build_mesh(plan, device_type="cpu"))
    optimizer = build_optimizer(model, plan, torch.optim.AdamW, lr=1e-3)
    (tokens,), targets = global_batches(Case("", plan, preset))[0]
    preset.loss(model(tokens[:plan.micro_batch_size]), targets[:plan.micro_batch_size]).backward()
    optimizer.step()
    return model, optimizer


def _full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"state_dict": model_state_dict(model, full=True),
            "optimizer_states": [optimizer_state_dict(model, optimizer, full=True)]}


def _checkpoints_of_split_vocabulary(rank: int, world_size: int, folder: str) -> dict[str, list[dict]]:
    """On every rank, for llama-tiny and the tied GPT-2 of 257 tokens split by vocabulary: the
    full state a trained model saves, and the full state of fresh models (other seeds) after each
    loaded the sharded checkpoint and the full file of it."""
    results = {}
    for name, preset, plan in (("llama", get_preset("llama-tiny"), Plan(**_VOCAB)),
                               ("gpt2", GPT2_TIED_257, Plan(**_GPT2_VOCAB))):
        model, optimizer = _trained(preset, plan, seed=0)
        saved = _full(model, optimizer)
        sharded, file = Path(folder) / f"{name}.ckpt", Path(folder) / f"{name}.pt"
        save_sharded_checkpoint(sharded, {"state_dict": model_state_dict(model, full=False),
                                          "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)]},
                                [optimizer])
        if rank == 0:
            torch.save(saved, file)
        dist.barrier()
        loaded = []
        for seed, path in ((1, sharded), (2, file)):
            fresh, fresh_optimizer = _trained(preset, plan, seed=seed)
            load_checkpoint(path, fresh, [fresh_optimizer], weights_only=False)
            loaded.append(_full(fresh, fresh_optimizer))
        results[name] = [saved, *loaded]
    return results


def test_split_vocabulary_saves_and_loads_full_weights(tmp_path):
    """Checkpoints of a model split by vocabulary (uneven and tied, or not) hold the model's own
    full weights under its own names, and load back, sharded or whole, into a split model."""
    results = run_on_ranks(_checkpoints_of_split_vocabulary, str(tmp_path), world_size=2)
    for name, preset in (("llama", get_preset("llama-tiny")), ("gpt2", GPT2_TIED_257)):
        saved, *loaded = results[name]
        assert saved["state_dict"].keys() == preset.build().state_dict().keys()
        assert saved["state_dict"]["tok_embeddings.weight"].shape == (preset.vocab_size, 64)
        for state in loaded:
            torch.testing.assert_close(state["state_dict"], saved["state_dict"], rtol=0, atol=0)
            (optimizer,), (expected,) = state["optimizer_states"], saved["optimizer_states"]
            torch.testing.assert_close(optimizer["state"], expected["state"], rtol=0, atol=0)
            assert [(g["params"], g["lr"]) for g in optimizer["param_groups"]] == \
                [(g["params"], g["lr"]) for g in expected["param_groups"]]


def _sequence_parallel_checks(rank: int, world_size: int) -> dict[str, object]:
    """On two ranks: the UsageError each rank raises at the first forward of a pinned SP plan the
    model cannot run (a sequence of 33 tokens; mixtral-tiny, whose router reads a norm), and the
    all-reduces an AdamW step runs after two accumulated backwards of llama-tiny under SP, built
    by ``build_optimizer`` and, beside it, built plainly (no hook)."""
    cases = {"uneven": ("llama-tiny", LLAMA_LAYOUT, 33), "router": ("mixtral-tiny", MIXTRAL_LAYOUT, 32)}
    results: dict[str, object] = {}
    for name, (preset, layout, seq_len) in cases.items():
        plan = Plan(**{**_TP2, "sequence_parallel": True, "tp_layout": layout})
        model = apply_plan(tiny_model(preset), plan, build_mesh(plan, device_type="cpu"))
        with pytest.raises(UsageError) as error:
            model(torch.randint(0, 64, (2, seq_len)))
        results[name] = str(error.value)
    plan = Plan(**{**_TP2, "sequence_parallel": True})
    for name, build in (("hooked", partial(build_optimizer, plan=plan, optimizer_cls=torch.optim.AdamW)),
                        ("plain", lambda module: torch.optim.AdamW(module.parameters()))):
        model = apply_plan(tiny_model(), plan, build_mesh(plan, device_type="cpu"))
        optimizer = build(model)
        for _ in range(2):
            model(torch.randint(0, 64, (2, 32))).float().pow(2).mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            optimizer.step()
        results[name] = sum(e.count for e in profile.key_averages() if e.key == "gloo:all_reduce")
        results[f"{name}_norm_grad"] = model.layers[0].ffn_norm.weight.grad.placements
    return results


@pytest.fixture(scope="module")
def sequence_parallel_checks() -> dict[str, object]:
    return run_on_ranks(_sequence_parallel_checks, world_size=2)


def test_a_pinned_sequence_parallel_plan_the_model_cannot_run_is_refused_clearly(sequence_parallel_checks):
    """Plans the search would not offer, pinned by hand: a clear error, not DTensor's own."""
    uneven, router = sequence_parallel_checks["uneven"], sequence_parallel_checks["router"]
    assert "the sequence length is 33" in uneven and "HINT" in uneven
    assert "hands layers.0.feed_forward.gate a norm's all-gathered output" in router
    assert "HINT: train this model without sequence_parallel" in router


def test_sequence_parallel_norm_grads_are_summed_once_a_step(sequence_parallel_checks):
    """llama-tiny's 8 norms leave Partial gradients. Without the hook DTensor sums each again for
    every AdamW operator that reads it (lerp_, and both operands of addcmul_: three); with it, one
    all-reduce before the step sums them all."""
    assert sequence_parallel_checks["plain"] == 3 * 8
    assert sequence_parallel_checks["plain_norm_grad"] == (Partial(),)
    assert sequence_parallel_checks["hooked"] == 1
    assert sequence_parallel_checks["hooked_norm_grad"] == (Replicate(),)
