"""profile_model on small hand-made models: attribution, block reuse, FLOPs against real runs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.flop_formulas import CPU_ATTENTION_FLOPS
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.search.enumeration import search_plans
from stratagem.advisor.search.targets import model_excludes
from stratagem.errors import UsageError
from stratagem.plan import Plan, Workload

from model_factories import Embedded


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.n_heads, -1).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, s, d))


class Toy(nn.Module):
    """Embedding, two groups of identical blocks (different widths), tied head."""

    def __init__(self, vocab: int = 97, dim: int = 32, wide: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim), Block(dim), Block(dim), nn.Linear(dim, wide), Block(wide), Block(wide)])
        self.down = nn.Linear(wide, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.down(x))


def _tokens(b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, 97, (b, s))


def _ce(output: torch.Tensor) -> torch.Tensor:
    return output.float().logsumexp(-1).mean()


def test_segments_partition_the_parameters_and_blocks_are_found():
    model = Toy()
    profile = profile_model(model, (_tokens(),), loss_fn=_ce, precision="fp32")
    assert profile.block_container == "layers"
    assert [b.name for b in profile.blocks] == [f"layers.{i}" for i in range(6)]
    assert profile.num_params == sum(p.numel() for p in model.parameters())
    assert profile.embed.num_params == model.emb.weight.numel()  # tied head weight counted once, here
    assert profile.head.num_params == sum(p.numel() for p in model.down.parameters())
    assert profile.blocks[0].num_params == sum(p.numel() for p in model.layers[0].parameters())
    assert profile.param_bytes == 4 * profile.num_params
    assert [x.name for x in profile.blocks[0].linears] == ["qkv", "proj"]
    assert {x.rows for b in profile.blocks for x in b.linears} == {2 * 16}  # batch × tokens, every block
    assert profile.num_heads == 4 and profile.batch_size == 2 and profile.seq_len == 16


def test_linears_keep_the_rows_they_multiplied_a_routed_expert_its_share():
    from stratagem.advisor.profile.cache import profile_spec

    moe = profile_spec("mixtral-tiny", seq_len=32, precision="fp32")  # 4 experts, top 2; two samples
    rows = {x.name: x.rows for x in moe.blocks[0].linears}
    assert rows["attention.wq"] == rows["feed_forward.gate"] == 2 * 32
    assert rows["feed_forward.experts.0.w1"] == rows["feed_forward.experts.3.w2"] == 2 * 32 * 2 // 4
    vit = profile_spec("vit-tiny", precision="fp32")  # 32×32 images in 8×8 patches, and the class token
    assert {x.rows for x in vit.blocks[0].linears} == {2 * (16 + 1)}


def test_reusing_identical_blocks_gives_the_same_numbers_as_measuring_each():
    model = Toy()
    for precision in ("fp32", "bf16-mixed"):
        fast = profile_model(model, (_tokens(),), loss_fn=_ce, precision=precision)
        slow = profile_model(model, (_tokens(),), loss_fn=_ce, precision=precision, reuse_identical_blocks=False)
        assert [b.measured_as for b in fast.blocks] == [None, "layers.0", "layers.0", None, None, "layers.4"]
        assert all(b.measured_as is None for b in slow.blocks)
        for a, b in zip(fast.segments, slow.segments, strict=True):
            assert a.to_dict() | {"measured_as": None} == b.to_dict(), a.name


def test_flops_equal_a_real_flop_count():
    torch.manual_seed(0)
    model = Toy()
    tokens = _tokens()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        _ce(model(tokens)).backward()
    profile = profile_model(model, (tokens,), loss_fn=_ce, precision="fp32")
    assert profile.flops_per_step == counter.get_total_flops()
    assert profile.embed.flops == 0
    assert profile.head.fwd_flops == 2 * 2 * 16 * (64 * 32 + 32 * 97)
    assert profile.blocks[0].bwd_flops > profile.blocks[0].fwd_flops > 0


def test_saved_bytes_equal_a_real_run_and_exclude_parameters():
    torch.manual_seed(0)
    model = Toy()
    tokens = _tokens()
    seen, total = set(), 0
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _ce(model(tokens))
    loss.backward()
    profile = profile_model(model, (tokens,), loss_fn=_ce, precision="fp32")
    assert profile.saved_bytes == total
    assert all(s.saved_param_copy_bytes == 0 for s in profile.segments)


def test_autocast_weight_copies_are_kept_apart_from_activations():
    model = Toy()
    profile = profile_model(model, (_tokens(),), loss_fn=_ce, precision="bf16-mixed")
    block = profile.blocks[0]
    linear_weights = sum(x.in_features * x.out_features for x in block.linears)
    assert block.saved_param_copy_bytes == 2 * linear_weights  # bf16 copies of both weights
    assert block.param_bytes == 4 * block.num_params  # master weights stay fp32


def test_block_bytes_in_and_out():
    profile = profile_model(Toy(), (_tokens(2, 16),), loss_fn=_ce, precision="bf16-true")
    assert profile.embed.output_bytes == 2 * 16 * 32 * 2
    assert profile.blocks[0].input_bytes == profile.blocks[0].output_bytes == 2 * 16 * 32 * 2
    assert profile.blocks[3].output_bytes == 2 * 16 * 64 * 2
    assert profile.head.output_bytes == 2 * 16 * 97 * 2


def test_model_on_meta_is_left_untouched():
    with torch.device("meta"):
        model = Toy()
    before = {n: (p.device, p.dtype) for n, p in model.named_parameters()}
    profile_model(model, (torch.zeros(1, 8, dtype=torch.long, device="meta"),), loss_fn=_ce)
    assert {n: (p.device, p.dtype) for n, p in model.named_parameters()} == before
    assert all("forward" not in m.__dict__ for m in model.modules())


class Reused(nn.Module):
    """The same block applied at two resolutions: the stand-in must not be trusted there."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(32), Block(32)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x)[:, ::2])


def test_identical_blocks_on_other_shapes_are_measured_for_real():
    x = torch.randn(2, 16, 32)
    fast = profile_model(Reused(), (x,), precision="fp32")
    slow = profile_model(Reused(), (x,), precision="fp32", reuse_identical_blocks=False)
    assert fast.blocks[1].measured_as is None
    assert fast.blocks[1].fwd_flops == slow.blocks[1].fwd_flops < fast.blocks[0].fwd_flops
    assert any("sum of the outputs" in note for note in fast.notes)


class _SavesItsOutput(nn.Module):
    """A block whose last operator saves its output (ReLU), as a bottleneck's does."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_a_stand_in_block_s_output_counts_once_where_the_block_saves_it():
    """Identical blocks between others, as in a convolutional network's stage: the stand-in for
    the third block inherits a count that holds its output (its ReLU saves it), and the fourth,
    which saves its input, must not count it again (bench/fake_parallel_peak.py's ResNet-50 at 64
    images: +5.6 % of its peak over abc8e0c, −0.0 % since)."""
    model = nn.Sequential(_SavesItsOutput(16, 32), _SavesItsOutput(32, 32), _SavesItsOutput(32, 32),
                          _SavesItsOutput(32, 16))
    x = torch.randn(2, 16, 16)
    fast, slow = (profile_model(model, (x,), precision="fp32", reuse_identical_blocks=reuse) for reuse in (True, False))
    assert fast.blocks[2].measured_as == "1"
    assert [b.saved_bytes for b in fast.blocks] == [b.saved_bytes for b in slow.blocks]


def test_a_block_called_on_an_input_saved_before_it_stands_for_none_called_on_a_new_one():
    """Identical blocks that save their input and output: the first takes the model's input, new,
    and counts it; the others take inputs the block before saved. The second is measured for real
    and stands for the rest (standing for the first, each would count its input again)."""
    model = nn.Sequential(*(_SavesItsOutput(32, 32) for _ in range(4)))
    x = torch.randn(2, 16, 32)
    fast, slow = (profile_model(model, (x,), precision="fp32", reuse_identical_blocks=reuse) for reuse in (True, False))
    assert [b.measured_as for b in fast.blocks] == [None, None, "1", "1"]
    assert [b.saved_bytes for b in fast.blocks] == [b.saved_bytes for b in slow.blocks]


class _ReturnsWhatItSaved(nn.Module):
    """A block returning its hidden state, which it does not save, beside a map it saved (as a
    Hugging Face BLOOM block returns its attention's probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        saved = self.fc(x).relu()
        return x + saved, saved


class _MapsBeside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ReturnsWhatItSaved() for _ in range(4))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return self.head(x)


def test_of_a_stand_in_s_outputs_only_those_its_block_saved_count_as_counted():
    """A stand-in's hidden state is new, as the block's own would be (its block does not save it):
    the next block, which saves its input, counts it (BLOOM-560M at 8 × 1024: −1.2 % of its peak
    while a stand-in's every output counted as saved)."""
    x = torch.randn(2, 16, 32)
    fast, slow = (profile_model(_MapsBeside(), (x,), precision="fp32", reuse_identical_blocks=reuse)
                  for reuse in (True, False))
    assert [b.measured_as for b in fast.blocks] == [None, "layers.0", "layers.0", "layers.0"]
    assert [s.saved_bytes for s in fast.segments] == [s.saved_bytes for s in slow.segments]


def test_models_without_blocks_and_keyword_inputs():
    model = nn.Sequential(nn.Linear(8, 16))
    profile = profile_model(model, {"input": torch.randn(4, 8)}, precision="fp32")
    assert profile.blocks == () and profile.block_container is None
    assert profile.embed.num_params == 8 * 16 + 16
    assert profile.embed.fwd_flops == 2 * 4 * 8 * 16
    assert profile.seq_len is None and profile.batch_size == 4


def test_bad_inputs_are_usage_errors():
    with pytest.raises(UsageError, match="no tensor"):
        profile_model(Toy(), (), precision="fp32")
    with pytest.raises(UsageError, match="bf16-mixed"):
        profile_model(Toy(), (_tokens(),), precision="bf16")


class _Misshapen(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(5, 5)  # x is [2, 4]


def test_a_model_that_fails_on_its_inputs_is_a_usage_error(capfd):
    """It says why; where the failing line is the model's own, which line (every frame of an
    nn.Sequential of Linears is torch's, and names none)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 5))
    with pytest.raises(UsageError, match=r"failed on its example inputs \(fake tensors\): .*same reduction dim"):
        profile_model(model, (torch.randn(2, 4),), precision="fp32")
    with pytest.raises(UsageError, match=r"failed on its example inputs \(fake tensors\), at \S*test_profile.py:\d+ "
                                         r"in forward: RuntimeError"):
        profile_model(_Misshapen(), (torch.randn(2, 4),), precision="fp32")
    assert "Traceback" not in capfd.readouterr().err


class _Routed(nn.Module):
    """Tokens to one of two Linears by a mask (``values``: a branch on a tensor's value instead)."""

    def __init__(self, values: bool = False) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.values = values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.values:
            return self.experts[int(x.sum() > 0)](x)
        chosen = x[:, 0] > 0
        out = torch.zeros_like(x)
        out[chosen] = self.experts[0](x[chosen])
        return out


@pytest.mark.parametrize(("values", "said"), [(False, "aten.nonzero.*shape depends on the data"),
                                              (True, "aten._local_scalar_dense.*value read from a tensor")])
def test_a_forward_that_reads_values_is_a_usage_error_that_says_so(values, said, capfd):
    """It names the op, what it means, and the model's line that read the value."""
    said += r".*, at \S*test_profile.py:\d+ in forward\)"
    with pytest.raises(UsageError, match=f"(?s)forward depends on its tensors' values.*{said}.*HINT: give every shape"):
        profile_model(_Routed(values), (torch.randn(8, 4),), precision="fp32")
    assert "Traceback" not in capfd.readouterr().err


class _GroupedExperts(nn.Module):
    """Two experts' weights multiplied by torch's grouped GEMM, as transformers' MoE layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        return torch._grouped_mm(x, self.weight, offs=offsets)


def test_grouped_gemms_are_counted():
    """torch's counter has no formula for ``_grouped_mm``: a Hugging Face MoE's experts were
    profiled at no FLOPs. Forward ``[16, 8] × [2, 8, 8]``; backward the input's gradient (the
    same GEMMs) and the weight's (``[8, 16] × [16, 8]`` in two groups of tokens)."""
    block = profile_model(Embedded(_GroupedExperts), (torch.randn(16, 8),), precision="bf16-true").blocks[1]
    assert (block.fwd_flops, block.bwd_flops) == (2 * 16 * 8 * 8, 2 * 2 * 16 * 8 * 8)


def test_a_grouped_gemm_on_float32_weights_leaves_only_fsdp_plans_or_says_what_would_run(capfd):
    """torch._grouped_mm takes no float32 weights and autocast does not cast for it: a bf16-mixed
    step is profiled as FSDP's mixed precision runs it (bfloat16 weights), the plans under autocast
    left out with the reason; in fp32 nothing runs, and the error says what would."""
    mixed = profile_model(_GroupedExperts(), (torch.randn(8, 8),), precision="bf16-mixed")
    assert "torch._grouped_mm" in mixed.autocast_refused and mixed.precision == "bf16-mixed"
    assert mixed.in_compute_dtype.precision == "bf16-true" and mixed.num_params == 128
    assert ModelProfile.from_dict(mixed.to_dict()) == mixed
    cluster, workload = parse_cluster("2xcpu"), Workload(global_batch_size=8, precision="bf16-mixed")
    excluded = Counter()
    plans = [plan for group in search_plans(mixed, cluster, workload, excluded=excluded) for plan in group]
    assert plans and all(plan.uses_fsdp for plan in plans)
    assert any("not runnable under autocast" in reason for reason in excluded)
    assert "under autocast" in model_excludes(mixed, cluster, Plan(dp_replicate=2, micro_batch_size=4,
                                                                    precision="bf16-mixed"))
    with pytest.raises(UsageError, match="(?s)torch._grouped_mm.*174763.*HINT: --precision bf16-true"):
        profile_model(_GroupedExperts(), (torch.randn(8, 8),), precision="fp32")
    assert "Traceback" not in capfd.readouterr().err


class _Elementwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x).view(-1) * self.scale).view_as(x)  # two outputs written, two views


def test_operators_without_flops_count_the_bytes_they_move_and_views_none():
    profile = profile_model(Embedded(_Elementwise), (torch.randn(4, 8),), loss_fn=lambda y: y.sum(), precision="fp32")
    # relu reads x and writes its output, mul reads that and the scale and writes its own: five
    # 32-float tensors; the views move nothing
    assert profile.blocks[0].fwd_op_bytes == 5 * 32 * 4
    assert profile.blocks[0].fwd_flops == 0 and profile.embed.fwd_flops > 0  # the Linear's bytes go as FLOPs


def test_grouped_query_attention_counts_as_many_key_heads_as_query_heads():
    """8 query heads over 4 key/value heads multiply as 8 pairs would (torch before 2.13 refused
    to count unequal heads; the count does not depend on torch's version)."""
    query, grouped, full = torch.Size([2, 8, 16, 32]), torch.Size([2, 4, 16, 32]), torch.Size([2, 8, 16, 32])
    forward, backward = (CPU_ATTENTION_FLOPS[op] for op in (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward))
    assert forward(query, grouped, grouped) == forward(query, full, full) == 2 * (2 * 2 * 8 * 16 * 16 * 32)
    assert backward(query, query, grouped, grouped) == backward(query, query, full, full) > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_gemms_with_rows_off_16_bytes_are_counted_apart(precision):
    """A 97-token vocabulary puts the head's output rows (and its weight's, in the backward's
    GEMMs) off 16 bytes in any dtype; 96 does not, and nothing else in the model is off."""
    odd = profile_model(Toy(vocab=97), (_tokens(),), loss_fn=_ce, precision=precision)
    head = 2 * 2 * 16 * 32 * 97  # tokens × the head's width × its vocabulary, 2 FLOPs each
    assert (odd.head.fwd_unaligned_flops, odd.head.bwd_unaligned_flops) == (head, 2 * head)
    assert all(s.fwd_unaligned_flops == s.bwd_unaligned_flops == 0 for s in (odd.embed, *odd.blocks))
    even = profile_model(Toy(vocab=96), (_tokens(),), loss_fn=_ce, precision=precision)
    assert all(s.fwd_unaligned_flops == s.bwd_unaligned_flops == 0 for s in even.segments)


def test_parameter_sized_outputs_are_counted_apart_and_do_not_grow_with_the_batch():
    """Under autocast a block's Linear weights and biases are cast to bf16 in forward (4 bytes
    read, 2 written each) and their gradients back to fp32 in backward (2 read, 4 written); the
    tied embedding's dense gradient is table-sized. Twice the batch moves twice the other bytes
    (but the sums over the batch that make the biases' gradients, bias-sized), the same of these."""
    small, large = (profile_model(Toy(), (_tokens(b),), loss_fn=_ce, precision="bf16-mixed") for b in (2, 4))
    block = Toy().layers[0]
    linear = sum(p.numel() for m in (block.qkv, block.proj) for p in m.parameters())
    assert (small.blocks[0].fwd_param_op_bytes, small.blocks[0].bwd_param_op_bytes) == (6 * linear, 6 * linear)
    assert small.embed.bwd_param_op_bytes >= 97 * 32 * 4
    for one, two in zip(small.segments, large.segments):
        assert (one.fwd_param_op_bytes, one.bwd_param_op_bytes) == (two.fwd_param_op_bytes, two.bwd_param_op_bytes)
        assert 2 * one.fwd_op_bytes == pytest.approx(two.fwd_op_bytes, rel=0.05)  # and the loss's scalars
        assert 2 * one.bwd_op_bytes == pytest.approx(two.bwd_op_bytes, rel=0.05)
    fp32 = profile_model(Toy(), (_tokens(),), loss_fn=_ce, precision="fp32")
    assert all(s.fwd_param_op_bytes == 0 for s in fp32.segments)


def test_activations_shaped_like_a_weight_still_grow_with_the_batch(tmp_path):
    """OPT flattens its residual stream to ``[tokens, width]``: at 2 × 32 tokens of width 64 the
    backward's activations have the square weights' shape and dtype, and are still no gradient."""
    pytest.importorskip("transformers")
    opt = {"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "ffn_dim": 256, "vocab_size": 128, "max_position_embeddings": 128, "word_embed_proj_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(opt))
    square, other = (profile_spec(f"hf:{tmp_path}", seq_len=seq, precision="bf16-mixed", cache=False).blocks[0]
                     for seq in (32, 33))
    assert square.bwd_param_op_bytes == other.bwd_param_op_bytes == square.fwd_param_op_bytes
    for field in ("bwd_op_bytes", "bwd_fused_op_bytes"):
        assert getattr(square, field) / 32 == pytest.approx(getattr(other, field) / 33, rel=0.01)


def test_a_weight_s_gradient_cast_counts_in_its_block_wherever_autograd_runs_it(tmp_path):
    """BLOOM's block hands its input's gradient back before three of its weights' gradient casts
    run: they still count in the block, not in the embedding the module tracker has moved to."""
    pytest.importorskip("transformers")
    bloom = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    profile = profile_spec(f"hf:{tmp_path}", seq_len=32, precision="bf16-mixed", cache=False)
    block = profile.blocks[0]
    assert block.bwd_param_op_bytes == block.fwd_param_op_bytes > 0  # each weight cast once each way
    embedding = 128 * 64
    assert profile.embed.bwd_param_op_bytes <= 4 * embedding * 4  # its own table's gradients, no block's


def test_the_head_s_largest_backward_output_is_the_loss_s_gradient_of_the_logits():
    """Under autocast the head writes bf16 logits and the loss upcasts them: the largest tensor
    its backward writes is their fp32 gradient (the tied weight's gradient, weight-shaped, is
    not counted)."""
    profile = profile_model(Toy(), (_tokens(2, 16),), loss_fn=_ce, precision="bf16-mixed")
    assert profile.head.output_bytes == 2 * 16 * 97 * 2
    assert profile.head.bwd_largest_output_bytes == 2 * 16 * 97 * 4


class _Holder(nn.Module):
    """Holds the model, as a LightningModule does, and has no forward: the step calls the child."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _training_step(holder: _Holder, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(holder.model(tokens).flatten(0, 1).float(), targets.flatten())


def test_a_training_step_puts_its_loss_in_the_head():
    """step_fn runs the whole step: cross-entropy over a 32k vocabulary saves the fp32
    log-probabilities and writes the fp32 logits' gradient, both in the head, where seeding
    backward with the sum of the logits has neither; the blocks are found and measured alike
    when the step calls a child of the profiled module."""
    vocab, logits_fp32 = 32_000, 2 * 16 * 32_000 * 4
    holder = _Holder(Toy(vocab=vocab))
    tokens = _tokens(2, 16)
    summed = profile_model(holder.model, (tokens,), precision="bf16-mixed")
    traced = profile_model(holder, ((tokens, _tokens(2, 16)),), step_fn=_training_step, precision="bf16-mixed")
    assert (traced.block_container, traced.batch_size, traced.seq_len) == ("model.layers", 2, 16)
    assert traced.head.bwd_largest_output_bytes >= logits_fp32 > summed.head.bwd_largest_output_bytes
    assert traced.head.saved_bytes >= logits_fp32 > summed.head.saved_bytes
    assert traced.head.fwd_ops > summed.head.fwd_ops
    assert traced.head.output_bytes == summed.head.output_bytes == 2 * 16 * vocab * 2  # forward's bf16 logits
    assert [b.saved_bytes for b in traced.blocks] == [b.saved_bytes for b in summed.blocks]
    assert traced.head.bwd_op_bytes > summed.head.bwd_op_bytes  # softmax, log and their gradients move bytes
    assert not traced.notes and "sum of the outputs" in summed.notes[0]


class _LossInside(nn.Module):
    """Computes its loss in its forward, as a Hugging Face model given its labels does."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Toy()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _ce(self.model(tokens))


def test_the_profile_tells_a_loss_the_forward_computes_from_one_after_it(tmp_path):
    """Where the loss runs decides what FSDP holds gathered at it (cost.buffers.estimate_buffers)."""
    tokens = _tokens()
    assert profile_model(_LossInside(), (tokens,), precision="fp32").loss_in_forward
    assert not profile_model(Toy(), (tokens,), loss_fn=_ce, precision="fp32").loss_in_forward
    traced = profile_model(_Holder(Toy()), ((tokens, _tokens()),), step_fn=_training_step, precision="fp32")
    assert not traced.loss_in_forward
    pytest.importorskip("transformers")
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    assert profile_spec(f"hf:{tmp_path}", seq_len=16, precision="fp32", cache=False).loss_in_forward  # its labels


class _CheckpointsItself(nn.Module):
    """Two MLP blocks the model's own forward checkpoints, or runs plainly (``placement`` None):
    ``around`` each block from the loop that calls it, non-reentrant or ``reentrant`` (torch's
    default where ``use_reentrant`` is not given), or ``wrapped`` in torch's ``checkpoint_wrapper``,
    which checkpoints inside the block's own call (as a Hugging Face model does after
    ``gradient_checkpointing_enable()``)."""

    def __init__(self, placement: str | None) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        super().__init__()
        self.emb = nn.Embedding(97, 32)
        layers = [nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)]
        self.layers = nn.ModuleList(map(checkpoint_wrapper, layers) if placement == "wrapped" else layers)
        self.head = nn.Linear(32, 97)
        self.placement = placement

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            if self.placement in ("around", "reentrant"):
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.placement == "reentrant")
            else:
                x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("placement", ["around", "reentrant", "wrapped"])
def test_a_model_that_checkpoints_its_own_blocks_recomputes_them_on_the_fake_state(precision, placement):
    """The recompute runs in backward: it ran after the profile's state swap had ended, on the
    model's own fp32 parameters, and under autocast checkpointing refused it (CheckpointError: the
    recomputed tensors' dtypes differ). Its work is the block's backward's: the first Linear again
    (torch's non-reentrant recompute stops after the last operator that saves a tensor, GELU), or
    the whole forward and its own backward (the reentrant one's, run as a backward of its own)."""
    checked, plain = (profile_model(_CheckpointsItself(p), (_tokens(),), loss_fn=_ce, precision=precision)
                      for p in (placement, None))
    block, unchecked = checked.blocks[0], plain.blocks[0]
    assert block.fwd_flops == unchecked.fwd_flops
    rerun = unchecked.fwd_flops if placement == "reentrant" else unchecked.fwd_flops / 2
    assert block.bwd_flops == unchecked.bwd_flops + rerun
    assert checked.embed.bwd_flops == plain.embed.bwd_flops


@pytest.mark.parametrize("placement", [None, "around", "wrapped"])
def test_a_block_s_backward_holds_the_gradients_of_its_activations_beyond_what_it_kept(placement):
    """The second Linear's backward writes the gradient of GELU's output (2 × 16 tokens × 64,
    fp32) while the block's output's gradient (× 32) is still there and nothing the block kept or
    rebuilt is freed yet: the most the block holds beyond them. At 32 tokens the first gradient
    has the second Linear's weight's shape (``[32, 64]``) and the weight's own gradient, which the
    model states count, comes a moment later: the profile tells them apart by what the
    parameters' ``AccumulateGrad`` takes."""
    profile = profile_model(_CheckpointsItself(placement), (_tokens(),), loss_fn=_ce, precision="fp32")
    assert [block.bwd_held_bytes for block in profile.blocks] == [2 * 16 * (64 + 32) * 4] * 2


class _Branches(nn.Module):
    """Two branches summed, then a ReLU, as a ResNet bottleneck ends: the branches' outputs stay
    alive (locals) through the sum and the ReLU, which alone saves its output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        shortcut = self.b(x)
        return (h + shortcut).relu()


class _BranchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, 32)
        self.layers = nn.ModuleList(_Branches() for _ in range(2))
        self.head = nn.Linear(32, 97)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_block_s_forward_holds_what_it_made_and_has_not_freed_beyond_what_it_saves():
    """At its ReLU the block holds both branches' outputs, their sum and the ReLU's output beside
    its input, which the Linears saved: three of its outputs' size beyond what it saves (the input,
    unless the block before saved it as its ReLU's output, and the ReLU's output). A full
    checkpoint's rerun holds as much again in backward, and saves the input the block saves itself
    from what the checkpoint kept."""
    profile = profile_model(_BranchModel(), (_tokens(),), loss_fn=_ce, precision="fp32")
    width = 2 * 16 * 32 * 4
    assert [block.saved_bytes for block in profile.blocks] == [2 * width, width]
    assert [block.input_saved_bytes for block in profile.blocks] == [width, 0]
    assert [block.fwd_held_bytes for block in profile.blocks] == [3 * width] * 2


def test_autocast_caches_every_weight_copy_the_forward_makes_saved_or_not():
    """Autocast's cache holds each compute-dtype copy of a weight to the forward's end: the biases',
    which no matmul saves, and those of a block the model checkpoints itself, whose checkpoint
    drops them (its rerun makes its own in backward, among what it rebuilds)."""
    checked, plain = (profile_model(_CheckpointsItself(p), (_tokens(),), loss_fn=_ce, precision="bf16-mixed")
                      for p in ("around", None))
    weights, biases = 2 * (32 * 64 + 64 * 32), 2 * (64 + 32)
    assert (plain.blocks[0].saved_param_copy_bytes, checked.blocks[0].saved_param_copy_bytes) == (weights, 0)
    assert plain.blocks[0].forward_param_copy_bytes == checked.blocks[0].forward_param_copy_bytes == weights + biases


@pytest.mark.parametrize("placement", ["around", "reentrant", "wrapped"])
def test_a_block_the_model_checkpoints_keeps_its_input_and_rebuilds_the_rest_in_its_backward(placement):
    """Checkpointed by the model, a block keeps its input from the forward, wherever the checkpoint
    call is placed (one around the block saves it before the block is entered, a reentrant one
    after it returned), and its backward holds what the rerun saves: all the block saves unchecked
    but the input (which the rerun reads, not copies), and after a reentrant rerun its output too,
    held while the rerun's own backward runs."""
    checked, plain = (profile_model(_CheckpointsItself(p), (_tokens(),), loss_fn=_ce, precision="fp32")
                      for p in (placement, None))
    width = 2 * 16 * 32 * 4  # the blocks' input and output, fp32
    for block, unchecked in zip(checked.blocks, plain.blocks, strict=True):
        assert block.saved_bytes == block.input_bytes == width
        assert block.rebuilt_bytes == unchecked.saved_bytes - width + (width if placement == "reentrant" else 0)
        assert unchecked.rebuilt_bytes == 0
    assert (checked.embed.saved_bytes, checked.head.saved_bytes) == (plain.embed.saved_bytes, plain.head.saved_bytes)


def test_a_step_that_returns_no_scalar_loss_is_a_usage_error():
    holder = _Holder(Toy())
    with pytest.raises(UsageError, match=r"step_fn returned a tensor of shape \[2, 16, 97\], not a scalar loss"):
        profile_model(holder, (_tokens(),), step_fn=lambda h, tokens: h.model(tokens), precision="fp32")
    with pytest.raises(UsageError, match="loss_fn or step_fn, not both"):
        profile_model(holder, (_tokens(),), step_fn=_training_step, loss_fn=_ce, precision="fp32")


class _Activated(nn.Module):
    """Blocks of one Linear and an activation between an embedding and a head."""

    def __init__(self, activation: type[nn.Module], dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, dim)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), activation()) for _ in range(2)])
        self.head = nn.Linear(dim, 97, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("activation", [nn.SiLU, nn.Mish])
def test_an_activation_gradient_is_the_one_kernel_the_device_runs(activation):
    """SiLU's and Mish's gradients run as one kernel (the output's gradient and the input read,
    the input's gradient written), as ReLU's does, though ATen gives them a decomposition beside
    it that FlopCounterMode would count instead: eight operators and several times the bytes."""
    relu, other = (profile_model(_Activated(a), (_tokens(),), loss_fn=_ce, precision="fp32").blocks[0]
                   for a in (nn.ReLU, activation))
    assert (other.bwd_ops, other.bwd_op_bytes) == (relu.bwd_ops, relu.bwd_op_bytes)
    activations, bias = 2 * 16 * 32 * 4, 32 * 4  # one fp32 tensor of the block's width; its bias
    assert other.bwd_op_bytes == 3 * activations + activations + bias  # the gradient; the bias's sum


def test_the_loss_backward_writes_the_log_probabilities_gradient_without_reading_them():
    """Cross-entropy's backward: nll's zeroes the log-probabilities' gradient and writes one element
    a row, reading none of them; log-softmax's reads that gradient and its output and writes the
    logits'. Four logits-sized tensors in all, beside the targets and two scalars (the loss's
    gradient, the count it divides by)."""
    targets = torch.randint(0, 97, (32,))
    profile = profile_model(_Activated(nn.ReLU), (_tokens(),), precision="fp32",
                            loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets))
    logits = 2 * 16 * 97 * 4
    assert profile.head.bwd_op_bytes == 4 * logits + 32 * 8 + 2 * 4


def test_a_block_whose_modules_enter_backward_late_keeps_its_backward(tmp_path):
    """A Hugging Face BLOOM block enters torch's module tracker in backward only at its attention's
    dropout: its MLP, output projection and scores' gradients run first. Each block still counts
    its whole backward, twice its forward, none of it in the embedding, and the step's total is
    what torch's own counter counts on real tensors."""
    config = {"model_type": "bloom", "n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_spec(f"hf:{tmp_path}", batch_size=2, seq_len=32, cache=False)
    embed, *blocks, _ = profile.segments
    assert embed.bwd_flops == 0 and all(b.bwd_flops == 2 * b.fwd_flops for b in blocks)
    assert profile.flops_per_step == _real_step_flops(tmp_path)


def test_a_module_the_tracker_never_leaves_stays_out_of_the_next_segment(tmp_path):
    """Hugging Face OPT's attention modules stay entered to the end of backward (one of their inputs
    gets no gradient): its ``project_in`` (a word-embedding width other than the model's) runs its
    backward after the blocks, and counts in the embedding, not in the first block."""
    config = {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "ffn_dim": 128, "vocab_size": 1000, "word_embed_proj_dim": 32, "pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_spec(f"hf:{tmp_path}", batch_size=2, seq_len=32, cache=False)
    embed = profile.segments[0]
    assert embed.bwd_flops == 2 * embed.fwd_flops == 2 * 2 * 64 * 32 * 64
    assert profile.flops_per_step == _real_step_flops(tmp_path)  # nothing counted twice


def _real_step_flops(config: Path) -> int:
    """FLOPs of one real step of the Hugging Face causal LM of ``config`` (its own loss), as torch's
    counter counts them with the profile's formulas for what it lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
    tokens = torch.randint(0, 1000, (2, 32))
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        model(tokens, labels=tokens).loss.backward()
    return counter.get_total_flops()
