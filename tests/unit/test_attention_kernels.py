"""SDPA profiled as CUDA runs it: the kernel CUDA picks by dtype, mask and head counts, and the
math path's s×s scores counted where CUDA takes it (fp32 with grouped key/value heads)."""

import json

import pytest
import torch

from stratagem.advisor.profile.attention import MATH_ATTENTION_NOTE, cuda_backend
from stratagem.advisor.profile.cache import profile_spec


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


def test_fp32_grouped_attention_keeps_the_scores_on_a_gpu():
    """llama-tiny (4 query heads, 2 key/value heads) in fp32: a GPU's profile saves each block's
    softmax output (b·heads·s·s fp32), which the CPU flash kernel does not; under bf16 autocast
    flash attention runs on both."""
    batch, seq, heads = 2, 32, 4
    gpu = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="fp32", kernels="gpu", cache=False)
    cpu = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="fp32", kernels="cpu", cache=False)
    assert MATH_ATTENTION_NOTE in gpu.notes and MATH_ATTENTION_NOTE not in cpu.notes
    scores = batch * heads * seq * seq * 4
    assert gpu.blocks[0].attention_saved_bytes >= scores > cpu.blocks[0].attention_saved_bytes
    mixed = profile_spec("llama-tiny", batch_size=batch, seq_len=seq, precision="bf16-mixed", cache=False)
    assert MATH_ATTENTION_NOTE not in mixed.notes


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
    assert MATH_ATTENTION_NOTE in fp32.notes
    assert MATH_ATTENTION_NOTE not in mixed.notes
