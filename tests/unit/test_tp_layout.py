"""The TP layout the profiler finds: Megatron pairs by structure, proven by a two-way split; the
input embedding and output head split by vocabulary, proven alike."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.model_profile import LinearLayer, policy_field
from stratagem.advisor.profile.profiler import profile_model

from model_factories import Embedded

LLAMA = {
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    "attention_norm": "sequence_parallel", "ffn_norm": "sequence_parallel",
}


# A preset's loss is stratagem's own, which verify runs on the logits' vocabulary shards: vocab_loss
# (a module profiled for a loss the user's code computes keeps vocab_head, the logits gathered).
VOCAB = {"tok_embeddings": "vocab_embedding", "output": "vocab_loss"}


def test_llama_preset_layout():
    profile = profile_spec("llama-tiny")
    assert dict(profile.tp_layout) == {f"layers.*.{name}": style for name, style in LLAMA.items()} | VOCAB
    assert profile.embed.vocab_params == profile.embed.num_params == 256 * 64  # the table, split
    assert profile.head.vocab_params == 256 * 64  # the output weight; the final norm's 64 stay whole
    assert profile.head.linears == (LinearLayer(name="output", in_features=64, out_features=256, bias=False,
                                                rows=profile.batch_size * profile.seq_len),)
    assert not profile.notes


def test_tied_gpt2_splits_its_one_weight_with_the_embedding():
    profile = profile_spec("gpt2-tiny")
    assert {p: s for p, s in profile.tp_layout if ".*." not in p} == VOCAB
    assert profile.embed.vocab_params == 256 * 64 < profile.embed.num_params  # positions stay whole
    assert profile.head.vocab_params == 0 and profile.head.linears[0].out_features == 256


class FixedVocabHead(nn.Linear):
    """A head that reshapes its logits to a vocabulary it was told: splitting it would be wrong."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(*x.shape[:-1], self.out_features)


class TinyLM(nn.Module):
    def __init__(self, head: type[nn.Linear] = nn.Linear, tie_to_block: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.layers = nn.ModuleList(_MLP() for _ in range(2))
        self.head = head(16, 40, bias=False)
        if tie_to_block:  # the table also feeds a block's Linear: not the head's alone
            self.layers[0].up = nn.Linear(16, 40, bias=False)
            self.layers[0].up.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize(("model", "split", "why"), [
    (TinyLM(), {"embed", "head"}, None),
    (TinyLM(FixedVocabHead), {"embed"}, "head (split two ways it fails: RuntimeError"),
    (TinyLM(tie_to_block=True), {"head"}, "embed (its weight is shared with layers.0.up)"),
])
def test_vocabulary_split_is_proven_or_left_out_with_the_reason(model, split, why):
    profile = profile_model(model, (torch.zeros(2, 8, dtype=torch.long),), precision="fp32")
    assert {name for name, style in profile.tp_layout if style.startswith("vocab_")} == split
    notes = " ".join(profile.notes)
    assert (why in notes) if why else "vocabulary" not in notes


def test_mixture_of_experts_splits_each_expert_and_keeps_the_router_whole():
    layout = dict(profile_spec("mixtral-tiny").tp_layout)
    assert layout["layers.*.feed_forward.experts.0.w1"] == "colwise"
    assert layout["layers.*.feed_forward.experts.3.w2"] == "rowwise"
    assert "layers.*.feed_forward.gate" not in layout


@pytest.mark.parametrize("kernels, widths", [("cpu", 6), ("gpu", 4)])
def test_what_a_split_leaves_whole_is_measured_per_block(kernels, widths):
    """Llama's block in fp32 keeps its two RMSNorms' inputs and the column Linears' inputs whole on
    every TP rank (four input widths, and each row's statistics); on a CPU each decomposed norm
    keeps its normalized input too, where the GPU's fused kernel keeps only the statistics."""
    block = profile_spec("llama-tiny", precision="fp32", kernels=kernels).blocks[0]
    assert block.tp_replicated_bytes / block.input_bytes == pytest.approx(widths, abs=0.2)
    assert block.tp_gathered_bytes == 2 * block.input_bytes  # what q, k, v and w1, w3 read, gathered under SP


@pytest.mark.parametrize("policy, widths", [("selective", 3), ("selective-op", 2)])
def test_what_a_split_leaves_whole_of_what_a_selective_policy_keeps(policy, widths):
    """A block checkpointed under a selective policy keeps its input and the kept matmuls' outputs:
    of those a TP split leaves whole on every rank the input and the row Linears' outputs (wo and
    w2 under ``selective``; w2 alone under ``selective-op``, which recomputes every second matmul,
    wo the fourth), each one input width; the column Linears' outputs and attention's are split."""
    block = profile_spec("llama-tiny", precision="fp32", kernels="gpu").blocks[0]
    replicated = getattr(block, policy_field(policy, "tp_replicated_bytes"))
    assert replicated == widths * block.input_bytes
    assert replicated < getattr(block, policy_field(policy, "kept_bytes"))  # the rest is split


def test_a_mixture_of_experts_keeps_its_routed_tokens_whole():
    """Every TP rank routes every token: what the experts' split leaves whole is more than a dense
    block's (the dispatched tokens and what combines their outputs)."""
    dense, moe = (profile_spec(name, precision="fp32", kernels="gpu").blocks[0]
                  for name in ("llama-tiny", "mixtral-tiny"))
    assert moe.tp_replicated_bytes / moe.input_bytes > 2 * dense.tp_replicated_bytes / dense.input_bytes


class _WideProbe(nn.Module):
    """An MLP the layout splits beside a wide Linear it leaves whole (it reads its own tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.whole = nn.Linear(16, 40), nn.Linear(40, 16), nn.Linear(16, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) + self.whole(2 * x).mean(-1, keepdim=True)


def test_a_weight_left_whole_is_no_activation_tp_keeps_whole():
    """Under autocast the Linear left whole saves its weight's 16-bit copy (256 × 16 × 2 bytes),
    which does not halve with the split: it is a copy of a parameter, not an activation kept
    whole (counted so, it had made every byte the block saves whole, the split MLP's included)."""
    profile = profile_model(Embedded(_WideProbe, width=16), (torch.randn(2, 8, 16),), precision="bf16-mixed")
    assert {name for name, _ in profile.tp_layout} == {"layers.*.up", "layers.*.down"}
    block = profile.blocks[0]
    assert block.saved_param_copy_bytes >= 256 * 16 * 2
    assert 0 < block.tp_replicated_bytes < block.saved_bytes / 2


def test_what_the_norms_and_residual_adds_cost_a_tp_rank_is_measured_per_block():
    """llama-tiny's RMSNorms: decomposed on CPU ranks (each operator of them a DTensor's under SP),
    one fused kernel each way on a GPU; without SP the split leaves the residual stream's work
    (norms, residual adds) whole, a share of the forward's bytes without FLOPs that fusing the
    norms shrinks."""
    cpu, gpu = (profile_spec("llama-tiny", precision="fp32", kernels=k).blocks[0] for k in ("cpu", "gpu"))
    assert cpu.sp_norm_ops > gpu.sp_norm_ops > 0
    shares = [b.tp_replicated_op_bytes / b.fwd_op_bytes for b in (cpu, gpu)]
    assert 0.2 < shares[0] < 0.7 and 0 < shares[1] < shares[0]


def test_a_router_reading_the_norm_keeps_sequence_parallelism_out():
    """Under SP a norm's output is all-gathered into a DTensor that only the column-split Linears
    take: an MoE's router reads it whole, and mixtral-small's ``tp4+sp`` failed so ("aten.mm got
    mixed torch.Tensor and DTensor", bench/accuracy.py) where the search had offered it."""
    assert "feed_forward.gate reads a norm's output" in profile_spec("mixtral-tiny").sp_unavailable
    assert profile_spec("llama-tiny").sp_unavailable is None


def test_hugging_face_llama_layout(tmp_path):
    pytest.importorskip("transformers")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    layout = dict(profile_spec(f"hf:{tmp_path}", seq_len=16).tp_layout)
    assert layout["model.layers.*.self_attn.q_proj"] == "colwise"
    assert layout["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert layout["model.layers.*.mlp.down_proj"] == "rowwise"
    assert layout["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert layout["model.embed_tokens"] == "vocab_embedding" and layout["lm_head"] == "vocab_loss"  # its own loss


def test_one_key_value_head_is_why_no_split_is_offered(tmp_path):
    """Multi-query attention (Gemma 3 1B's one key/value head): the two-way split fails where the
    key's heads are reshaped, and the reason says so rather than quoting the reshape."""
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    profile = profile_spec(f"hf:{tmp_path}", seq_len=16, cache=False)
    assert profile.tp_layout == ()
    assert profile.tp_unavailable.startswith("its 1 key/value head cannot be split two ways")


class FixedHeads(nn.Module):
    """Attention that hard-codes its head count: splitting its projections would be wrong."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


def test_a_block_that_cannot_be_split_gets_no_layout_and_a_reason():
    model = nn.Sequential(FixedHeads(), FixedHeads())
    profile = profile_model(model, (torch.randn(2, 8, 32),), precision="fp32")
    assert profile.tp_layout == ()
    assert "splitting 0 two ways fails" in profile.tp_unavailable


def test_blocks_without_linears_get_no_layout():
    profile = profile_spec("resnet-50")
    assert profile.tp_layout == () and "pair no column-split Linear" in profile.tp_unavailable


def test_hugging_face_declared_plan_is_used():
    """A model's own ``base_model_tp_plan`` wins over the structural pairing (here: attention only)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.config.base_model_tp_plan = {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {
        "layers.*.self_attn.o_proj": "rowwise"}
    layout = dict(profile_model(model, (torch.zeros(2, 16, dtype=torch.long),)).tp_layout)
    assert layout["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert not any("mlp" in pattern for pattern in layout)
    model.config.base_model_tp_plan = {"layers.*.mlp.experts": "moe_tp_experts"}  # not ours: structure decides
    layout = dict(profile_model(model, (torch.zeros(2, 16, dtype=torch.long),)).tp_layout)
    assert layout["model.layers.*.mlp.down_proj"] == "rowwise"


def test_hugging_face_plan_that_splits_the_head_otherwise_keeps_it_whole():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert model.tp_plan["lm_head"] == "colwise_gather_output"  # what vocab_head is
    model._tp_plan = {**model._tp_plan, "lm_head": "rowwise_split_input"}
    profile = profile_model(model, (torch.zeros(2, 16, dtype=torch.long),))
    assert [p for p, s in profile.tp_layout if s.startswith("vocab_")] == ["model.embed_tokens"]
    assert "lm_head (the model's own TP plan makes it 'rowwise_split_input')" in " ".join(profile.notes)


def test_a_hugging_face_layer_that_fills_a_cache_splits_on_a_copy_of_it():
    """Through a training step (the Lightning strategy's ``training_step``) a Hugging Face Llama
    hands each layer the cache it fills; the two-way split runs each time on a copy of the cache as
    the layer received it (it had run on the filled one, and failed). The compiled trace, which
    cannot take the cache, prices the layers with their eager bytes and says so."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, 256, (2, 32))

    def training_step(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = module(input_ids=batch).logits  # use_cache: the config's default, True
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    profile = profile_model(model, (tokens,), step_fn=training_step, batch_size=2, seq_len=32)
    assert profile.tp_unavailable is None and profile.tp_layout
    assert [note for note in profile.notes if "called with DynamicCache" in note]
    assert not any(block.compiled_saved_bytes for block in profile.blocks)
