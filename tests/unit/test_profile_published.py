"""The profile against numbers worked out by hand and published formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.profiler import profile_model
from stratagem.models import Transformer, get_preset


def _gpt2_block_profile(precision: str, *, b: int = 2, s: int = 128):
    """GPT-2 (h=768, a=12) with attention written out and dropout 0.1; two layers suffice."""
    config = dataclasses.replace(get_preset("gpt2").config, attention="explicit", dropout=0.1, n_layers=2)
    with torch.device("meta"):
        model = Transformer(config)
    tokens = torch.zeros(b, s, dtype=torch.long)
    return profile_model(model, (tokens,), loss_fn=lambda out: out.float().mean(), precision=precision)


def test_gpt2_block_saved_bytes_match_the_hand_count_in_fp32():
    b, s, h, a = 2, 128, 768, 12
    block = _gpt2_block_profile("fp32", b=b, s=s).blocks[0]
    # Every tensor the block keeps for backward, in fp32 (4 bytes), masks at 1 byte (CUDA):
    #   attention_norm: input x 4sbh, mean and rstd 2·4sb; its output (wq/wk/wv input) 4sbh
    #   q (wq output) 4sbh; k and v (repeat_interleave copies) 2·4sbh
    #   causal mask s² (bool); softmax output 4as²b; dropout mask as²b; dropped probs 4as²b
    #   wo input (heads merged) 4sbh; residual dropout mask sbh
    #   ffn_norm: input h 4sbh, mean and rstd 2·4sb; output (w1 input) 4sbh
    #   w1 output (gelu input) 16sbh; gelu output (w2 input) 16sbh; residual dropout mask sbh
    sbh = s * b * h
    expected = (4 + 4 + 4 + 8 + 4 + 1 + 4 + 4 + 16 + 16 + 1) * sbh + 9 * a * s * s * b + 16 * s * b + s * s
    assert block.saved_bytes == expected


def test_gpt2_block_saved_bytes_match_korthikanti_in_16_bit():
    b, s, h, a = 2, 128, 768, 12
    block = _gpt2_block_profile("bf16-true", b=b, s=s).blocks[0]
    korthikanti = s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al. 2022, eq. (1)
    # Beyond the formula: the bool causal mask (s²) and the two LayerNorms' bf16 mean/rstd (8sb).
    assert block.saved_bytes == korthikanti + s * s + 8 * s * b
    # What selective recomputation drops: softmax output, dropout mask and output (5as²b);
    # what it redoes: QKᵀ and AV forward.
    assert block.attention_saved_bytes == 5 * a * s * s * b
    assert block.attention_fwd_flops == 2 * 2 * b * s * s * h


def test_fused_attention_saves_no_scores():
    profile = profile_spec("gpt2", batch_size=2, seq_len=128, precision="bf16-true")
    block = profile.blocks[0]
    assert block.attention_saved_bytes == 0
    assert block.attention_fwd_flops == 2 * 2 * 2 * 128 * 128 * 768


def test_llama_2_7b_flops_match_6_n_tokens_plus_attention():
    s, b = 4096, 1
    profile = profile_spec("llama-2-7b", batch_size=b, seq_len=s)
    config = get_preset("llama-2-7b").config
    n = profile.num_params - profile.embed.num_params  # the embedding is a lookup, not a matmul
    # 6·N·T for the weights; attention counted as FlopCounterMode counts the fused kernels
    # (full s×s, causality ignored): QKᵀ and AV forward (4·b·s²·d), and backward recomputing
    # QKᵀ then four more matmuls (10·b·s²·d), per layer.
    formula = 6 * n * b * s + 14 * config.n_layers * b * s * s * config.dim
    assert profile.flops_per_step == pytest.approx(formula, rel=0.03)
    # seq_len equals the width here: only the fused attention counts as the attention core.
    assert profile.blocks[0].attention_fwd_flops == 4 * b * s * s * config.dim
    assert profile.bwd_flops == pytest.approx(2 * profile.fwd_flops, rel=0.1)


def test_mixtral_is_profiled_with_balanced_routing():
    profile = profile_spec("mixtral-8x7b", seq_len=512)
    assert profile.num_params == 46_702_792_704
    assert any("balanced" in note for note in profile.notes)
    block = profile.blocks[0]
    dense_expert = 3 * 2 * 512 * 4096 * 14336  # one SwiGLU expert over every token, forward
    assert block.fwd_flops > 2 * dense_expert  # top-2: each token visits two experts


def test_image_models_profile_as_samples():
    profile = profile_spec("resnet-50", batch_size=4, precision="fp32")
    assert profile.num_params == 25_557_032 and profile.seq_len is None
    assert len(profile.blocks) == 16 and profile.blocks[1].measured_as is None  # stride differs
    assert profile.blocks[2].measured_as == "layers.1"
    # ResNet-50 forward is about 4.1 GMAC per 224×224 image.
    assert profile.fwd_flops / 4 == pytest.approx(2 * 4.1e9, rel=0.05)
