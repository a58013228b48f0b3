"""The TP layout the profiler finds: Megatron pairs by structure, proven by a two-way split."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.profile.cache import profile_spec

LLAMA = {
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    "attention_norm": "sequence_parallel", "ffn_norm": "sequence_parallel",
}


def test_llama_preset_layout():
    layout = profile_spec("llama-tiny").tp_layout
    assert dict(layout) == {f"layers.*.{name}": style for name, style in LLAMA.items()}


def test_mixture_of_experts_splits_each_expert_and_keeps_the_router_whole():
    layout = dict(profile_spec("mixtral-tiny").tp_layout)
    assert layout["layers.*.feed_forward.experts.0.w1"] == "colwise"
    assert layout["layers.*.feed_forward.experts.3.w2"] == "rowwise"
    assert "layers.*.feed_forward.gate" not in layout


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
