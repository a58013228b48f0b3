"""The models ``verify`` builds for real: presets, factories and ``hf:`` configs (in this process:
the spawned ranks are tests/dist's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.verify.models import fallback_loss, real_model
from stratagem.verify.runner import MEMORY_STEPS, measure_plan

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


@pytest.mark.parametrize(("spec", "says"), [
    ("no-such-preset", "unknown model 'no-such-preset'"),
    ("no_such_module:factory", "cannot load factory"),
    ("model_factories:needs_seq_len", "requires seq_len"),
    ("hf:/no/such/config.json", "no Hugging Face config"),
])
def test_what_is_wrong_with_a_name_is_found_before_building(spec: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        real_model(spec, seq_len=None)


def test_a_factory_is_called_for_real_with_the_rank_s_batch_size_and_its_loss() -> None:
    torch.manual_seed(0)
    built = real_model("model_factories:mlp_with_targets", seq_len=None).build(4, None)
    (inputs,) = built.batch.args
    assert inputs.shape == (4, 16) and not inputs.is_meta and built.batch.targets is None
    loss = built.loss(built.module(inputs), None)
    assert loss.dim() == 0 and loss.requires_grad


def test_a_factory_s_batch_that_does_not_fit_the_plan_is_a_usage_error() -> None:
    model = real_model("model_factories:mlp_with_loss", seq_len=None)  # two samples, no batch_size parameter
    assert model.build(2, None).batch.args[0].shape[0] == 2
    with pytest.raises(UsageError, match="give the factory a batch_size parameter"):
        model.build(4, None)


def test_verify_ranks_only_plans_a_factory_s_own_batch_can_feed() -> None:
    """A factory without batch_size makes the batch it makes: each plan's forward must take it
    (verify of such a CNN at --global-batch-size 16 had ranked two plans of 8, and both failed)."""
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.cli.verify_cmd import _fixed_batch

    own = profile_spec("model_factories:mlp_four_samples", precision="fp32")
    assert _fixed_batch("model_factories:mlp_four_samples", own) == {"micro_batch_size": 4, "microbatches": 1}
    told = profile_spec("model_factories:mlp", precision="fp32")
    assert _fixed_batch("model_factories:mlp", told) == {} and _fixed_batch("gpt2-tiny", told) == {}


def test_the_fallback_loss_is_the_profiler_s() -> None:
    class Output:
        loss = torch.tensor(3.0)

    assert fallback_loss(Output()).item() == 3.0
    assert fallback_loss(torch.tensor(2.0)).item() == 2.0
    weight = torch.ones(2, requires_grad=True)
    assert fallback_loss((weight * 2, torch.ones(3))).item() == 4.0  # the outputs needing gradients, summed
    with pytest.raises(UsageError, match="nothing to train"):
        fallback_loss(torch.ones(3))


def test_an_hf_config_trains_with_random_tokens_and_the_model_s_own_loss(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    model = real_model(f"hf:{tmp_path}", seq_len=16)
    torch.manual_seed(0)
    batch = model.make_batch(3)
    (ids,) = batch.args
    assert ids.shape == (3, 16) and ids.dtype == torch.long and int(ids.max()) < 256
    assert batch.targets is ids and batch.kwargs == {"use_cache": False}
    built = model.build(3, batch)
    output = built.module(ids, labels=ids, use_cache=False)
    assert torch.allclose(built.loss(output, ids), output.loss)  # the loss its forward computes from labels
    assert torch.allclose(built.loss(output.logits, ids), output.loss)  # a pipeline's last stage: logits


def test_an_hf_model_type_without_sdpa_trains_with_eager_attention(tmp_path: Path) -> None:
    bloom = {"model_type": "bloom", "hidden_size": 32, "n_layer": 1, "n_head": 2, "vocab_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    model = real_model(f"hf:{tmp_path}", seq_len=8)
    batch = model.make_batch(2)
    built = model.build(2, batch)
    assert built.module.config._attn_implementation == "eager"
    output = built.module(*batch.args, labels=batch.targets, use_cache=False)
    assert torch.isfinite(built.loss(output, batch.targets))


def test_measure_plan_reports_the_build_and_every_step(one_rank) -> None:
    events = []
    measured = measure_plan(real_model("model_factories:mlp", seq_len=None), Plan(micro_batch_size=2, precision="fp32"),
                            optimizer="adamw", steps=2, warmup=1,
                            on_event=lambda kind, **fields: events.append((kind, fields.get("phase"))))
    assert measured.step_seconds > 0 and measured.steps == 2
    assert events == [("built", None), *[("step", "warm-up")] * (MEMORY_STEPS + 1), *[("step", "measured")] * 2]


@pytest.mark.parametrize("how", ["norm", "value"])
def test_measure_plan_clips_every_step_s_gradients_as_the_workload_says(one_rank, monkeypatch, how) -> None:
    """Each step, warm-up and measured, clips through the plugins' clipping (the real one, counted)."""
    from stratagem.verify import runner

    calls = []
    real = getattr(runner, f"clip_grad_{how}_")
    monkeypatch.setattr(runner, f"clip_grad_{how}_", lambda params, limit: calls.append(limit) or real(params, limit))
    measure_plan(real_model("model_factories:mlp", seq_len=None), Plan(micro_batch_size=2, precision="fp32"),
                 optimizer="adamw", grad_clip=how, steps=2, warmup=1)
    assert calls == [runner.CLIP_AT] * (MEMORY_STEPS + 1 + 2)


def test_a_factory_s_keyword_inputs_reach_the_model_and_the_fallback_loss_trains_it(one_rank) -> None:
    model = real_model("model_factories:mlp_keyword_inputs", seq_len=None)
    built = model.build(3, None)
    assert built.batch.args == () and built.batch.kwargs["input"].shape == (3, 16)
    measured = measure_plan(model, Plan(micro_batch_size=3, precision="fp32"), optimizer="sgd", steps=1, warmup=0)
    assert measured.step_seconds > 0


_TINY = {"micro_batch_size": 2, "precision": "fp32", "block_container": "layers"}


@pytest.mark.parametrize(("spec", "plan", "on_meta"), [
    ("llama-tiny", Plan(dp_shard=2, zero=3, **_TINY), True),  # FSDP shards it
    ("llama-tiny", Plan(tp=2, tp_layout=(("layers.*.attention.wq", "colwise"),), **_TINY), True),
    ("llama-tiny", Plan(pp=2, microbatches=2, **_TINY), True),  # stages built by removal
    ("llama-tiny", Plan(pp=2, dp_shard=2, zero=3, microbatches=2, **_TINY), True),
    ("llama-tiny", Plan(**_TINY), False),  # one rank holds it all
    ("llama-tiny", Plan(dp_replicate=2, **_TINY), False),  # DDP broadcasts real tensors
    ("llama-tiny", Plan(pp=2, dp_replicate=2, microbatches=2, **_TINY), False),
    ("vit-tiny", Plan(pp=2, microbatches=2, **_TINY), False),  # tracing runs the model
    ("model_factories:mlp", Plan(dp_shard=2, zero=3, micro_batch_size=2, precision="fp32"), False),  # it makes its batch
])
def test_a_plan_that_gives_each_rank_a_part_builds_the_model_on_meta(spec: str, plan: Plan, on_meta: bool) -> None:
    """No rank of an FSDP, TP or removal-built pipeline plan holds the whole model: it is built on
    meta and each rank materializes its part; everything else is built for real."""
    from stratagem.verify.runner import _build

    model = real_model(spec, seq_len=16 if spec == "llama-tiny" else None)
    batch = model.make_batch(2) if model.make_batch is not None else None
    built = _build(model, plan, 2, batch, torch.device("cpu"))
    assert all(p.is_meta is on_meta for p in built.module.parameters())
    assert not any(t.is_meta for t in (*built.batch.args, built.batch.targets) if isinstance(t, torch.Tensor))
