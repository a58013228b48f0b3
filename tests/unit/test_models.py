"""Reference model presets: published sizes, shapes, training, MoE routing, attention variants."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from stratagem.errors import UsageError
from stratagem.models import (
    PRESETS,
    MoEFeedForward,
    Transformer,
    TransformerConfig,
    get_preset,
)
from stratagem.models.moe import balanced_counts
from stratagem.models.transformer import rope_tables

# Published parameter counts: the papers / model cards for the language models, torchvision's
# vit_b_16, vit_l_16, resnet50 and resnet101 for the vision models.
PUBLISHED_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mixtral-8x7b": 46_702_792_704,
    "vit-b-16": 86_567_656,
    "vit-l-16": 304_326_632,
    "resnet-50": 25_557_032,
    "resnet-101": 44_549_160,
}
TINY = ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "vit-tiny", "resnet-tiny"]
# The small presets (for benchmarks on CPU processes): the counts their descriptions state.
SMALL_PARAMETERS = {"llama-small": 5_048_576, "mixtral-small": 5_639_424, "vit-small": 3_251_556}


def build_on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return get_preset(name).build()


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def test_every_preset_is_tested() -> None:
    assert set(PRESETS) == set(PUBLISHED_PARAMETERS) | set(TINY) | set(SMALL_PARAMETERS)


@pytest.mark.parametrize("name", [*PUBLISHED_PARAMETERS, *SMALL_PARAMETERS])
def test_parameter_count_equals_published(name: str) -> None:
    model = build_on_meta(name)
    assert num_parameters(model) == {**PUBLISHED_PARAMETERS, **SMALL_PARAMETERS}[name]
    assert all(p.device.type == "meta" for p in model.parameters())


def test_70b_builds_on_meta_quickly() -> None:
    start = time.perf_counter()
    build_on_meta("llama-2-70b")
    assert time.perf_counter() - start < 3.0  # about 0.6 s; generous for a loaded CI machine


def test_build_honours_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_on_meta("llama-tiny")
    finally:
        torch.set_default_dtype(previous)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_llama_3_has_gqa_rope_swiglu_rmsnorm() -> None:
    model = build_on_meta("llama-3-8b")
    block = model.layers[0]
    assert block.attention.wq.weight.shape == (4096, 4096)
    assert block.attention.wk.weight.shape == (8 * 128, 4096)  # 8 key/value heads of 128
    assert block.feed_forward.w3 is not None
    assert isinstance(block.attention_norm, nn.RMSNorm)
    assert model.pos_embeddings is None and model.config.pos == "rope"
    assert model.output.weight is not model.tok_embeddings.weight


def test_gpt2_has_learned_positions_gelu_layernorm_tied_output() -> None:
    model = build_on_meta("gpt2")
    block = model.layers[0]
    assert block.feed_forward.w3 is None
    assert isinstance(block.attention_norm, nn.LayerNorm)
    assert model.pos_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight


def test_mixtral_feed_forward_is_sparse() -> None:
    model = build_on_meta("mixtral-8x7b")
    moe = model.layers[0].feed_forward
    assert isinstance(moe, MoEFeedForward)
    assert len(moe.experts) == 8 and moe.top_k == 2
    assert moe.gate.bias is None and moe.experts[0].w3 is not None


@pytest.mark.parametrize("name", [*TINY, *SMALL_PARAMETERS])
def test_cpu_preset_forward_shape(name: str) -> None:
    preset = get_preset(name)
    torch.manual_seed(0)
    inputs, targets = preset.make_batch(2)
    output = preset.build()(*inputs)
    if preset.input_kind == "tokens":
        assert inputs[0].shape == targets.shape == (2, preset.default_seq_len)
        assert output.shape == (2, preset.default_seq_len, preset.vocab_size)
    else:
        assert inputs[0].shape == (2, 3, preset.image_size, preset.image_size)
        assert output.shape == (2, preset.num_classes)


@pytest.mark.parametrize("name", TINY)
def test_tiny_trains(name: str) -> None:
    preset = get_preset(name)
    torch.manual_seed(0)
    model = preset.build()
    inputs, targets = preset.make_batch(4, 32 if preset.input_kind == "tokens" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        loss = preset.loss(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # overfitting one batch


@pytest.mark.parametrize("name", TINY)
def test_init_weights_after_to_empty_matches_cpu_build(name: str) -> None:
    """Build on meta, ``to_empty``, ``init_weights``: the same weights (and ties) as on the CPU."""
    on_cpu = get_preset(name).build()
    deferred = build_on_meta(name).to_empty(device="cpu")
    for model in (on_cpu, deferred):
        torch.manual_seed(0)
        model.init_weights()
    torch.testing.assert_close(deferred.state_dict(), on_cpu.state_dict(), rtol=0, atol=0)
    assert num_parameters(deferred) == num_parameters(on_cpu)


def naive_moe(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the top-k gate logits, weighted sum of those experts."""
    rows = []
    for token in x.reshape(-1, x.size(-1)):
        logits, chosen = moe.gate(token).topk(moe.top_k)
        weights = logits.softmax(-1)
        rows.append(sum(w * moe.experts[int(e)](token) for w, e in zip(weights, chosen)))
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("shape", [(3, 10), (1, 1)], ids=["30-tokens", "1-token-idle-experts"])
def test_moe_matches_token_by_token_reference(shape: tuple[int, int]) -> None:
    config = get_preset("mixtral-tiny").config
    torch.manual_seed(0)
    moe = MoEFeedForward(config)
    moe.init_weights(out_std=0.02)
    x = torch.randn(*shape, config.dim)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_moe_runs_forward_and_backward_on_fake_tensors() -> None:
    preset = get_preset("mixtral-tiny")
    with FakeTensorMode():
        model = preset.build()
        inputs, targets = preset.make_batch(2)
        loss = preset.loss(model(*inputs), targets)
        loss.backward()
    assert isinstance(loss, FakeTensor) and isinstance(inputs[0], FakeTensor)
    assert all(p.grad is not None for p in model.parameters())


def test_balanced_counts_spread_the_remainder() -> None:
    assert balanced_counts(10, 4) == [3, 3, 2, 2]
    assert balanced_counts(8, 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_explicit_attention_matches_sdpa(name: str) -> None:
    config = get_preset(name).config
    torch.manual_seed(0)
    sdpa = Transformer(config)
    explicit = Transformer(dataclasses.replace(config, attention="explicit"))
    explicit.load_state_dict(sdpa.state_dict())
    (tokens,), _ = get_preset(name).make_batch(2, 16)
    torch.testing.assert_close(explicit(tokens), sdpa(tokens), rtol=1e-5, atol=1e-5)


def test_attention_keeps_working_when_heads_are_sharded() -> None:
    """Tensor parallelism's split: wq/wk/wv by output rows, wo by input columns. Each half
    computes its own heads (here 2 query heads sharing 1 key/value head) and the partial
    outputs sum to the unsharded attention."""
    config = get_preset("llama-tiny").config
    torch.manual_seed(0)
    attention = Transformer(config).layers[0].attention
    x = torch.randn(2, 8, config.dim)
    rope = rope_tables(8, config.head_dim, theta=config.rope_theta, device=x.device)
    partial_outputs = []
    for rank in range(2):
        shard = copy.deepcopy(attention)
        for linear in (shard.wq, shard.wk, shard.wv):
            linear.weight = nn.Parameter(linear.weight.chunk(2, dim=0)[rank])
        shard.wo.weight = nn.Parameter(shard.wo.weight.chunk(2, dim=1)[rank])
        partial_outputs.append(shard(x, rope))
    torch.testing.assert_close(sum(partial_outputs), attention(x, rope))


def test_pipeline_stages_compose_to_the_whole_model() -> None:
    """Stages that drop the modules they don't own, chained, give the unsplit output."""
    preset = get_preset("llama-tiny")
    torch.manual_seed(0)
    whole = preset.build()
    first, last = preset.build(), preset.build()
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    first.layers, first.norm, first.output = first.layers[:2], None, None
    last.layers, last.tok_embeddings = last.layers[2:], None
    (tokens,), _ = preset.make_batch(2, 16)
    torch.testing.assert_close(last(first(tokens)), whole(tokens))


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(UsageError, match=r"(?s)known presets: gpt2, .*llama-2-7b.*HINT:"):
        get_preset("gpt5")


def test_config_names_the_bad_field() -> None:
    shape = {"vocab_size": 10, "dim": 64, "n_layers": 1, "ffn_dim": 8, "max_seq_len": 8}
    with pytest.raises(ValueError, match="n_kv_heads"):
        TransformerConfig(**shape, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads.*64.*divisible.*5"):
        TransformerConfig(**shape, n_heads=5)
    with pytest.raises(ValueError, match="norm.*layernorm, rmsnorm"):
        TransformerConfig(**shape, n_heads=4, norm="batchnorm")


def test_learned_positions_reject_long_sequences() -> None:
    preset = get_preset("gpt2-tiny")
    (tokens,), _ = preset.make_batch(1, preset.default_seq_len + 1)
    with pytest.raises(UsageError, match="max_seq_len"):
        preset.build()(tokens)


def test_moe_presets_carry_the_balanced_routing_note() -> None:
    assert any("balanced" in note for note in get_preset("mixtral-8x7b").notes)
    assert get_preset("llama-3-8b").notes == ()


def test_image_preset_warns_about_ignored_seq_len() -> None:
    with pytest.warns(UserWarning, match="seq_len=16 is ignored"):
        get_preset("vit-tiny").make_batch(1, 16)
