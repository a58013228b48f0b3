"""A GPU profile under ``*-mixed`` follows CUDA's autocast: a softmax over the scores of a bf16
matmul runs in float32 there (bf16 under CPU autocast), unless the call names its dtype."""

import pytest
import torch
from torch import nn

from stratagem.advisor.profile.autocast import CudaAutocast
from stratagem.advisor.profile.profiler import profile_model


class _Scores(nn.Module):
    """Explicit attention scores over a bf16 matmul, softmaxed without (or with) a dtype."""

    def __init__(self, named_dtype: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.named_dtype = named_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = h @ h.transpose(-2, -1)
        probs = scores.softmax(-1, dtype=scores.dtype) if self.named_dtype else scores.softmax(-1)
        return probs @ h


def _saved(named_dtype: bool, kernels: str) -> int:
    profile = profile_model(_Scores(named_dtype), (torch.randn(2, 32, 16),), precision="bf16-mixed", kernels=kernels)
    return sum(s.saved_bytes for s in profile.segments)


def test_a_gpu_keeps_the_softmax_of_bf16_scores_in_float32():
    scores = 2 * 32 * 32  # elements of the softmax's output
    assert _saved(False, "gpu") - _saved(False, "cpu") >= scores * (4 - 2)
    assert _saved(True, "gpu") == _saved(True, "cpu")


@pytest.mark.parametrize(("call", "expected"), [
    (lambda x: x.softmax(-1), torch.float32),
    (lambda x: torch.exp(x), torch.float32),
    (lambda x: x ** 2, torch.float32),
    (lambda x: x.softmax(-1, dtype=torch.bfloat16), torch.bfloat16),  # a named dtype is kept
    (lambda x: x.relu(), torch.bfloat16),  # not on CUDA's float32 list
])
def test_cuda_s_float32_list_under_cpu_autocast(call, expected):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocast():
        assert call(x).dtype == expected
    with CudaAutocast():  # autocast off: nothing is cast
        assert call(x).dtype == torch.bfloat16
