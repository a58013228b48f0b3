"""Pipeline plans match one process: GPipe, 1F1B, interleaved 1F1B and interleaved zero-bubble on
2 and 4 ranks, pipelines composed with DDP, FSDP and tensor parallelism on 4 ranks, and with TP
and FSDP at once on 8, trained on real gloo processes (one spawn per world size, shared with the other dist tests:
``conftest.py``), with activation checkpointing on the stages of one.

The single process runs the same micro-batches one after another, each loss divided by the
number of micro-batches, as the Pipeline divides each micro-batch's loss.
Tolerance: fp32 as the data-parallel tests (``rtol=1e-5, atol=1e-6``), as the tensor-parallel
tests with TP. ``atol=1e-5`` where a weight's true gradient is about zero, so its rounding noise
becomes an AdamW update of ~1e-6 (observed): ViT's key bias (softmax ignores a constant added to
every score; 6.0e-6 after 5 steps) and single elements under pipeline × FSDP or DDP (1.3e-6;
5.2e-6 with full checkpointing). Stages of the reference Transformer are built by removal; ViT and ResNet stages
by tracing, alone and under DDP and FSDP. Uneven pinned partitions (``stage_blocks``) and the even default are both run. GPT-2's
tied embedding and head train across stages alone, with DDP, FSDP and the vocabulary split by TP.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
from spawn import run_on_ranks
from test_data_parallel import CLIP, FP32, TIED_FP32, assert_matches_single_process
from test_tensor_parallel import GPT2_LAYOUT, GPT2_TIED_257, LLAMA_LAYOUT, TP_FP32, VOCAB, VOCAB_LOSS
from training import SEQ_LEN, Case, global_batches, train_single

from stratagem.advisor.cost.activations import estimate_activations
from stratagem.advisor.cost.rank_view import rank_view
from stratagem.plan import Plan
from stratagem.advisor.profile.profiler import profile_model
from stratagem.errors import UsageError
from stratagem.models import get_preset
from stratagem.models.transformer import Transformer
from stratagem.plugins import apply_plan
from stratagem.plugins.pipeline import split_stages, tied_parameters


def _deeper(name: str, layers: int):
    """``name`` with ``layers`` blocks: interleaving over 4 ranks needs 8 stages."""
    preset = get_preset(name)
    config = replace(preset.config, n_layers=layers)
    return replace(preset, name=f"{name}-{layers}", config=config, build=partial(Transformer, config))


LLAMA_8 = _deeper("llama-tiny", 8)

_PP2 = {"pp": 2, "microbatches": 4, "micro_batch_size": 2, "precision": "fp32", "block_container": "layers"}

TWO_RANKS = {case.name: case for case in [
    Case("pp2_gpipe_pinned", Plan(pp_schedule="gpipe", stage_blocks=(1, 3), **_PP2)),
    Case("pp2_1f1b", Plan(pp_schedule="1f1b", **_PP2)),
    Case("pp2_interleaved", Plan(pp_schedule="interleaved-1f1b", pp_virtual=2, **_PP2)),
    Case("pp2_zero_bubble", Plan(pp_schedule="interleaved-zb", pp_virtual=2, **_PP2)),
    Case("pp2_vit_traced", Plan(**_PP2), preset="vit-tiny"),
    Case("pp2_resnet_traced", Plan(pp_schedule="gpipe", stage_blocks=(3, 1), **_PP2), preset="resnet-tiny"),
    Case("pp2_tied", Plan(pp_schedule="1f1b", **_PP2), preset="gpt2-tiny"),
    Case("pp2_tied_clip", Plan(pp_schedule="1f1b", **_PP2), preset="gpt2-tiny", clip=CLIP),
]}
FOUR_RANKS = {case.name: case for case in [
    Case("pp4_1f1b", Plan(**{**_PP2, "pp": 4})),
    Case("pp4_interleaved", Plan(**{**_PP2, "pp": 4}, pp_schedule="interleaved-1f1b", pp_virtual=2),
         preset=LLAMA_8),
    Case("pp2_ddp2", Plan(dp_replicate=2, **_PP2)),
    Case("pp2_gpipe_ddp2", Plan(dp_replicate=2, **{**_PP2, "pp_schedule": "gpipe", "microbatches": 2})),
    Case("pp2_fsdp2", Plan(dp_shard=2, zero=3, pp_schedule="gpipe", **_PP2)),
    Case("pp2_zero2_full_ckpt", Plan(dp_shard=2, zero=2, activation_checkpointing="full", **_PP2)),
    Case("pp2_tp2", Plan(tp=2, tp_layout=(*LLAMA_LAYOUT, *VOCAB), **_PP2),  # the vocabulary split too
         optimizer="adamw-foreach"),
    Case("pp2_tp2_sp", Plan(tp=2, sequence_parallel=True, tp_layout=(*LLAMA_LAYOUT, *VOCAB), **_PP2),
         optimizer="adamw-foreach"),
    Case("pp2_interleaved_tp2_sp", Plan(tp=2, sequence_parallel=True, tp_layout=LLAMA_LAYOUT,
                                        **{**_PP2, "pp_schedule": "interleaved-1f1b", "pp_virtual": 2}),
         optimizer="adamw-foreach"),
    Case("pp2_zero_bubble_tp2", Plan(tp=2, tp_layout=LLAMA_LAYOUT, pp_schedule="interleaved-zb", pp_virtual=2,
                                     **_PP2), optimizer="adamw-foreach"),
    Case("pp2_ddp2_tied", Plan(dp_replicate=2, **_PP2), preset="gpt2-tiny"),
    Case("pp2_fsdp2_vit_traced", Plan(dp_shard=2, zero=3, **_PP2), preset="vit-tiny"),
    Case("pp2_ddp2_vit_traced", Plan(dp_replicate=2, **_PP2), preset="vit-tiny"),
    Case("pp2_fsdp2_tied", Plan(dp_shard=2, zero=3, **_PP2), preset="gpt2-tiny"),
    Case("pp2_tp2_vocab_tied", Plan(tp=2, tp_layout=(*GPT2_LAYOUT, *VOCAB), **_PP2), preset=GPT2_TIED_257,
         optimizer="adamw-foreach"),
    Case("pp2_tp2_sp_clip", Plan(tp=2, sequence_parallel=True, tp_layout=(*LLAMA_LAYOUT, *VOCAB_LOSS), **_PP2),
         optimizer="adamw-foreach", clip=CLIP),  # the loss on the logits' vocabulary shards
]}
# all of it at once: stages split by TP with SP and the vocabulary, sharded by FSDP, clipped by the
# norm over every rank's share (TP and FSDP shards, both stages)
EIGHT_RANKS = {case.name: case for case in [
    Case("pp2_tp2_sp_fsdp2_clip", Plan(tp=2, sequence_parallel=True, dp_shard=2, zero=3,
                                       tp_layout=(*LLAMA_LAYOUT, *VOCAB), **_PP2),
         optimizer="adamw-foreach", clip=CLIP),
    Case("pp2_interleaved_tp2_zero2_full_ckpt",
         Plan(tp=2, dp_shard=2, zero=2, activation_checkpointing="full", tp_layout=LLAMA_LAYOUT,
              **{**_PP2, "pp_schedule": "interleaved-1f1b", "pp_virtual": 2}), optimizer="adamw-foreach"),
]}
TIED = {"pp2_tied": 2, "pp2_tied_clip": 2, "pp2_ddp2_tied": 4, "pp2_fsdp2_tied": 4,
        "pp2_tp2_vocab_tied": 4}  # by world size


NEAR_ZERO_GRADIENTS = {"pp2_vit_traced", "pp2_fsdp2", "pp2_zero2_full_ckpt", "pp2_ddp2", "pp2_gpipe_ddp2",
                       "pp2_fsdp2_vit_traced", "pp2_ddp2_vit_traced"}


@pytest.mark.parametrize("name", [name for name in TWO_RANKS if name not in TIED])
def test_two_rank_pipeline_matches_single_process(two_ranks, name):
    tolerance = TIED_FP32 if name in NEAR_ZERO_GRADIENTS else FP32
    assert_matches_single_process(TWO_RANKS[name], two_ranks[name], tolerance)


@pytest.mark.parametrize("name", ["pp4_1f1b", "pp4_interleaved", "pp2_ddp2", "pp2_gpipe_ddp2", "pp2_fsdp2",
                                  "pp2_zero2_full_ckpt", "pp2_fsdp2_vit_traced", "pp2_ddp2_vit_traced"])
def test_four_rank_pipeline_matches_single_process(four_ranks, name):
    tolerance = TIED_FP32 if name in NEAR_ZERO_GRADIENTS else FP32
    assert_matches_single_process(FOUR_RANKS[name], four_ranks[name], tolerance)


@pytest.mark.parametrize("name", ["pp2_tp2", "pp2_zero_bubble_tp2", "pp2_tp2_sp", "pp2_interleaved_tp2_sp",
                                  "pp2_tp2_sp_clip"])
def test_pipeline_tp_matches_single_process(four_ranks, name):
    """TP inside pipeline stages, with SP too, where each stage (each virtual stage of an
    interleaved schedule) splits its sequence and gathers it at its own edges; clipped by the
    norm over both stages (``Pipeline.clip_grad_norm_``), a tied weight counted once; the clipped
    case's loss on the logits' vocabulary shards (``vocab_loss``), run by the schedule under
    ``vocab_parallel_loss``, its predictions gathered whole."""
    assert_matches_single_process(FOUR_RANKS[name], four_ranks[name], TP_FP32)
    if name == "pp2_tp2_sp_clip":
        vocab = get_preset("llama-tiny").vocab_size
        assert four_ranks[name].facts["predicted"] == ("Tensor", (8, SEQ_LEN, vocab))


@pytest.mark.parametrize("name", list(EIGHT_RANKS))
def test_a_pipeline_of_tp_and_fsdp_ranks_matches_single_process(eight_ranks, name):
    """pp × tp × FSDP, the layout large models train with, on 8 ranks: each stage's TP ranks
    shard its units over the FSDP ranks; with SP, the vocabulary split and clipping, or
    interleaved stages under ZeRO-2 with full checkpointing."""
    assert_matches_single_process(EIGHT_RANKS[name], eight_ranks[name], TP_FP32)


@pytest.mark.parametrize("name", list(TIED))
def test_tied_weights_on_the_first_and_last_stage_train_as_one(request, name):
    """The first stage holds the tied embedding, the last a copy as the head; the copy takes the
    embedding's values before the first step and both add the sum of their gradients, so the two
    stay bit-equal and the model trains as in one process (Megatron-LM's scheme)."""
    cases, runs = (TWO_RANKS, "two_ranks") if TIED[name] == 2 else (FOUR_RANKS, "four_ranks")
    run = request.getfixturevalue(runs)[name]
    weights = dict(run.weights)
    head = weights.pop("output.weight")  # the single process names the tied weight once
    torch.testing.assert_close(head, weights["tok_embeddings.weight"], rtol=0, atol=0)
    tolerance = TP_FP32 if "tp2" in name else TIED_FP32
    assert_matches_single_process(cases[name], replace(run, weights=weights), tolerance)


@pytest.mark.parametrize("name", ["pp4_interleaved", "pp2_fsdp2", "pp2_tp2"])
def test_pipeline_state_dict_splits_the_model_s_own(four_ranks, name):
    """Each rank's ``Pipeline.state_dict()`` (DTensor shards under FSDP/TP) holds its stages
    under the model's own names; together the pipeline ranks cover the model's state once."""
    keys = four_ranks[name].facts["state_dict_keys"]
    plan = FOUR_RANKS[name].plan
    pp_ranks = [set(keys[r]) for r in range(0, plan.world_size, plan.world_size // plan.pp)]
    assert sum(map(len, pp_ranks)) == len(set().union(*pp_ranks))
    assert set().union(*pp_ranks) == set(FOUR_RANKS[name].model.build().state_dict())


@pytest.mark.parametrize("name", ["pp2_gpipe_pinned", "pp2_1f1b", "pp2_interleaved"])
def test_forward_only_schedule_gives_the_trained_model_s_loss(two_ranks, name):
    """``Pipeline.evaluate`` after training: the mean micro-batch loss of the first batch under
    the single process's final weights, on every rank."""
    case = TWO_RANKS[name]
    model = case.model.build()
    model.load_state_dict(train_single(case).weights)
    (tokens,), targets = global_batches(case)[0]
    with torch.no_grad():
        expected = torch.stack([case.model.loss(model(t), y) for t, y in
                                zip(tokens.split(case.plan.micro_batch_size), targets.split(case.plan.micro_batch_size))])
    assert two_ranks[name].facts["eval_loss"] == pytest.approx([expected.mean().item()] * 2, rel=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_a_pipeline_rank_holds_no_parameter_but_its_stages(request, world):
    """Once the plan is applied (the caller has dropped the model), no other parameter is alive on
    any rank: tracing's graph modules of the whole model are collected (reference cycles), and a
    traced stage's generated code no longer holds the parameters FSDP replaced by shards."""
    runs = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    cases = TWO_RANKS if world == 2 else FOUR_RANKS
    stale = {name: runs[name].facts["stale_parameters"] for name in cases if any(runs[name].facts["stale_parameters"])}
    assert not stale


def test_pipeline_dp_wraps_each_stage(four_ranks):
    assert four_ranks["pp2_ddp2"].facts["wrapper"] == ["DistributedDataParallel"]
    assert four_ranks["pp4_interleaved"].facts["wrapper"] == ["Transformer", "Transformer"]


@pytest.mark.parametrize("world, name", [(2, "pp2_gpipe_pinned"), (2, "pp2_1f1b"), (2, "pp2_interleaved"),
                                         (4, "pp4_1f1b"), (4, "pp4_interleaved")])
def test_memory_model_holds_what_each_stage_holds(request, world, name):
    """The activations each pipeline rank keeps for backward at the peak of its schedule (the
    second step's: the first also runs the stages' shape inference), against the memory model
    for that rank, its stages and the micro-batches each holds. Observed within 0.5 %."""
    case = (TWO_RANKS if world == 2 else FOUR_RANKS)[name]
    run = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")[name]
    preset = case.model
    (tokens,), _ = preset.make_batch(case.plan.micro_batch_size, SEQ_LEN)
    profile = profile_model(preset.build(), (tokens,), precision="fp32", kernels="cpu",
                            loss_fn=lambda out: preset.loss(out, torch.zeros(out.shape[:-1], dtype=torch.long)))
    estimated = [estimate_activations(rank_view(profile, case.plan, r)) for r in range(case.plan.pp)]
    assert run.facts["peak_saved_bytes"] == pytest.approx(estimated, rel=0.01)


def _sequential() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)))


def _hf_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _hf_phi3() -> torch.nn.Module:
    """Fused Q/K/V: not among the decoders whose stages are built by removal, so traced; its
    config keeps ``use_cache`` on, as Hugging Face's do."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config)


_STAGE_MODELS = {  # model, block container, one batch of its inputs
    "llama-tiny (removal)": (lambda: get_preset("llama-tiny").build(), "layers", lambda: torch.randint(0, 256, (2, 16))),
    "nn.Sequential (removal)": (_sequential, "", lambda: torch.randn(2, 8)),
    "Hugging Face Llama (removal)": (_hf_llama, "model.layers", lambda: torch.randint(0, 128, (2, 16))),
    "Hugging Face Phi3 (traced)": (_hf_phi3, "model.layers", lambda: torch.randint(0, 128, (2, 16))),
    "vit-tiny (traced)": (lambda: get_preset("vit-tiny").build(), "layers", lambda: torch.randn(2, 3, 32, 32)),
    "resnet-tiny (traced)": (lambda: get_preset("resnet-tiny").build(), "layers", lambda: torch.randn(2, 3, 64, 64)),
}


@pytest.mark.parametrize("name", list(_STAGE_MODELS))
def test_stages_chain_to_the_whole_model_under_its_own_names(name):
    """Built as the engine builds them (no process group needed), the stages of an uneven
    partition run in turn give the whole model's output, and their state dicts split the
    model's by its own keys (a pipeline checkpoint reloads into the unsplit model). Traced
    stages run their graphs' generated code, not ``torch.fx.Interpreter``."""
    build, container, make_input = _STAGE_MODELS[name]
    model, x = build(), make_input()  # train mode, as a pipeline runs it
    whole = model(x)
    whole = getattr(whole, "logits", whole)
    num_blocks = len(model.get_submodule(container))
    plan = Plan(pp=2, microbatches=2, precision="fp32", block_container=container, stage_blocks=(num_blocks - 1, 1))
    first, last = (split_stages(model, plan, pp_rank=r, example_inputs=(x,))[0] for r in range(2))
    between = first(x)  # a traced stage may pass several tensors on (Phi3's rotary tables and mask)
    out = last(*between) if isinstance(between, tuple) else last(between)
    out = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    torch.testing.assert_close(out, whole, rtol=0, atol=0)  # the same ops in the same order
    keys = [set(stage.state_dict()) for stage in (first, last)]
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(model.state_dict())
    assert not any(getattr(m, "_run_with_interpreter", False) for s in (first, last) for m in s.modules())


def test_traced_stages_carry_what_later_stages_read():
    """Phi3's rotary tables and mask are computed before the first block and read by every block:
    traced into four stages (two per rank, interleaved), each stage hands them on with its output,
    where the third had been called without them."""
    model, x = _hf_phi3(), torch.randint(0, 128, (2, 16))
    whole = model(x).logits
    plan = Plan(pp=2, pp_virtual=2, pp_schedule="interleaved-1f1b", microbatches=2, precision="fp32",
                block_container="model.layers", stage_blocks=(1, 1, 1, 1))
    (first, third), (second, fourth) = (split_stages(model, plan, pp_rank=r, example_inputs=(x,)) for r in range(2))
    out = x
    for stage in (first, second, third, fourth):
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, whole, rtol=0, atol=0)


def test_tied_weights_a_pipeline_can_keep_and_those_it_cannot():
    """A tied embedding and head (outside the blocks) are copied to the first and last stage; a
    weight blocks share would be split by the stages, and offloaded copies cannot be summed on the
    device: both refused before anything changes."""
    plan = Plan(pp_schedule="1f1b", **_PP2)
    assert tied_parameters(get_preset("gpt2-tiny").build(), plan) == (("tok_embeddings.weight", "output.weight"),)
    assert tied_parameters(get_preset("llama-tiny").build(), plan) == ()
    shared = get_preset("llama-tiny").build()
    shared.layers[1].attention.wq.weight = shared.layers[0].attention.wq.weight
    with pytest.raises(UsageError, match="(?s)layers.0.attention.wq.weight and layers.1.attention.wq.weight.*HINT"):
        tied_parameters(shared, plan)
    offloaded = Plan(dp_shard=2, zero=3, offload="params", **_PP2)
    with pytest.raises(UsageError, match="(?s)CPU offload of a pipeline.s tied weights.*HINT: untie"):
        tied_parameters(get_preset("gpt2-tiny").build(), offloaded)


def test_traced_stages_refuse_tensor_parallelism():
    plan = Plan(tp=2, tp_layout=(("layers.*.attention.wq", "colwise"),), **_PP2)
    with pytest.raises(UsageError, match="(?s)traced.*tensor parallelism.*HINT"):  # before the mesh is read
        apply_plan(get_preset("vit-tiny").build(), plan, None, loss_fn=torch.nn.functional.mse_loss)


def _accumulated_tied_gradients(rank: int, world_size: int, batches: list) -> list:
    """Two steps of a GPT-2 pipeline into the same gradients (accumulation): every rank's copies of
    the tied embedding's gradient (rank 0's embedding, rank 1's head), and its first block's
    query weight's gradient where it holds that block."""
    import torch.distributed as dist

    from stratagem.plugins import build_mesh

    preset = get_preset("gpt2-tiny")
    plan = Plan(pp_schedule="1f1b", **_PP2)
    torch.manual_seed(0)
    pipe = apply_plan(preset.build(), plan, build_mesh(plan, device_type="cpu"), loss_fn=preset.loss)
    for tokens, targets in batches:
        pipe.step(tokens, target=targets)
    stage = pipe.modules[0]
    copy = stage.tok_embeddings.weight if rank == 0 else stage.output.weight
    grads = [copy.grad.clone(), stage.layers[0].attention.wq.weight.grad.clone() if rank == 0 else None]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, grads)
    return gathered


def test_tied_copies_sum_what_each_accumulated_step_gave():
    """Two steps into the same gradients: both copies hold the sum over both steps of the
    embedding's and the head's gradients, as one process accumulates the tied weight's (the first
    step's sum is not counted twice by the second step's all-reduce), and every gradient is the sum
    of the two steps' means (torch's ``scale_grads`` divided the first step's again)."""
    preset = get_preset("gpt2-tiny")
    torch.manual_seed(1)
    batches = [preset.make_batch(_PP2["micro_batch_size"] * _PP2["microbatches"], SEQ_LEN) for _ in range(2)]
    batches = [(tokens, targets) for (tokens,), targets in batches]
    copies = run_on_ranks(_accumulated_tied_gradients, batches, world_size=2)
    torch.manual_seed(0)
    model = preset.build()
    for tokens, targets in batches:  # the schedule's mean over micro-batches, summed over the two steps
        for t, y in zip(tokens.split(_PP2["micro_batch_size"]), targets.split(_PP2["micro_batch_size"])):
            (preset.loss(model(t), y) / _PP2["microbatches"]).backward()
    (first, block), (last, _) = copies
    torch.testing.assert_close(first, model.tok_embeddings.weight.grad, **FP32)
    torch.testing.assert_close(last, first, rtol=0, atol=0)
    torch.testing.assert_close(block, model.layers[0].attention.wq.weight.grad, **FP32)
