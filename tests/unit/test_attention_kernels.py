"""SDPA profiled as CUDA runs it: the kernel CUDA picks by dtype, mask and head counts, and the
math path's s×s scores counted where CUDA takes it (fp32 with grouped key/value heads)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stratagem.advisor.profile.attention import MATH_ATTENTION_NOTE, cuda_backend
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.profiler import profile_model


def _math_note(profile) -> str:
    """The profile's note on attention CUDA runs on its math path ("" where none)."""
    return next((note for note in profile.notes if note.startswith(MATH_ATTENTION_NOTE)), "")


def _qkv(heads: int, kv_heads: int, head_dim: int = 64, seq: int = 16) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(2, h, seq, head_dim, device="meta") for h in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim", "mask", "expected"), [
    (torch.bfloat16, 8, 2, 64, False, "flash"),  # flash takes grouped heads
    (torch.float16, 8, 8, 256, False, "flash"),
    (torch.float32, 8, 8, 64, False, "efficient"),  # no flash kernel in fp32
    (torch.bfloat16, 8, 8, 64, True, "efficient"),  # flash takes no explicit mask
    (torch.bfloat16, 8, 8, 512, False, "efficient"),  # over flash's head size
    (torch.float32, 8, 2, 64, False, "math"),  # fp32 and grouped heads: no fused kernel
    (torch.bfloat16, 8, 2, 64, True, "math"),  # a mask and grouped heads
    (torch.float32, 8, 8, 62, False, "math"),  # a head row off 16 bytes
])
def test_cuda_picks_the_kernel_sdp_utils_allows(dtype, heads, kv_heads, head_dim, mask, expected):
    q, k, v = _qkv(heads, kv_heads, head_dim)
    attn_mask = torch.empty(16, 16, dtype=torch.bool, device="meta") if mask else None
    assert cuda_backend(q, k, v, dtype=dtype, attn_mask=attn_mask, is_causal=not mask) == expected


def test_grouped_heads_without_enable_gqa_take_the_math_path():
    """One key/value head for eight query heads, passed without ``enable_gqa``: flash attention
    refuses it, and only the math path's matmuls broadcast the key's head."""
    q, k, v = _qkv(8, 1)
    assert cuda_backend(q, k, v, dtype=torch.bfloat16, is_causal=True, enable_gqa=False) == "math"
    assert cuda_backend(q, k, v, dtype=torch.bfloat16, is_causal=True, enable_gqa=True) == "flash"


def test_fp32_grouped_attention_keeps_the_scores_on_a_gpu():
    """llama-tiny (4 query heads, 2 key/value heads) in fp32: a GPU's profile saves each block's
    softmax output (b·heads·s·s fp32), which the CPU flash kernel does not; under bf16 autocast
    flash attention runs on both."""
    batch, seq, heads = 2, 32, 4
    gpu = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="fp32", kernels="gpu", cache=False)
    cpu = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="fp32", kernels="cpu", cache=False)
    assert _math_note(gpu) and not _math_note(cpu)
    scores = batch * heads * seq * seq * 4
    assert gpu.blocks[0].attention_saved_bytes >= scores > cpu.blocks[0].attention_saved_bytes
    mixed = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="bf16-mixed", cache=False)
    assert not _math_note(mixed)


def test_hugging_face_rows_are_profiled_unpacked(tmp_path):
    """A Hugging Face Qwen2 with grouped heads: on fake tensors its mask builder cannot read the
    position ids, and would build an explicit mask; profiled as it runs on real unpacked rows, it
    leaves causality to SDPA and passes grouped heads, which CUDA runs on the math path in fp32."""
    pytest.importorskip("transformers")
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = f"hf:{tmp_path / 'config.json'}"
    fp32 = profile_spec(spec, batch_size=2, seq_len=32, precision="fp32", cache=False)
    mixed = profile_spec(spec, batch_size=2, seq_len=32, precision="bf16-mixed", cache=False)
    assert "grouped key/value heads in float32" in _math_note(fp32)
    assert not _math_note(mixed)


class _Attention(nn.Module):
    """One attention layer: query and key heads of ``qk`` elements, value heads of ``v``, SDPA
    with ``dropout`` while training."""

    def __init__(self, qk: int = 32, v: int = 32, dropout: float = 0.0, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qk, self.v, self.dropout = heads, qk, v, dropout
        self.q, self.k = (nn.Linear(64, heads * qk) for _ in range(2))
        self.value, self.out = nn.Linear(64, heads * v), nn.Linear(heads * v, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def split(t: torch.Tensor, width: int) -> torch.Tensor:
            return t.view(b, s, self.heads, width).transpose(1, 2)

        attended = F.scaled_dot_product_attention(split(self.q(x), self.qk), split(self.k(x), self.qk),
                                                  split(self.value(x), self.v), is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        return x + self.out(attended.transpose(1, 2).reshape(b, s, -1))


class _Layers(nn.Module):
    def __init__(self, **attention: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(**attention) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("attention", [{"dropout": 0.1}, {"qk": 48, "v": 32}], ids=["dropout", "value heads apart"])
def test_attention_a_fused_cuda_kernel_takes_keeps_no_scores(attention):
    """The CPU's flash kernel takes neither dropout nor a value head size other than the query's
    (DeepSeek's latent attention), and SDPA on CPU tensors runs the math path, saving the s×s
    scores; CUDA runs them fused (flash attention, the memory-efficient kernel), as the profile
    now does: a block saves less beyond the plain block's than one s×s tensor (a dropout seed,
    wider queries and keys), where the math path keeps several."""
    x = torch.randn(2, 128, 64)
    plain = profile_model(_Layers(), (x,), precision="bf16-mixed").blocks[0]
    profile = profile_model(_Layers(**attention), (x,), precision="bf16-mixed")
    scores = 2 * 4 * 128 * 128 * 2  # one bf16 s×s tensor
    assert not any(note.startswith(MATH_ATTENTION_NOTE) for note in profile.notes)
    assert profile.blocks[0].saved_bytes < plain.saved_bytes + scores
    assert profile.blocks[0].attention_fwd_flops > 0
