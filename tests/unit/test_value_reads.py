"""Values a forward reads from its tensors, answered on fake tensors as a real step answers them."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.profile.value_reads import ValueReads


class _LayerDrop(nn.Module):
    """Three Linears, each skipped when a scalar draw falls below ``layerdrop`` (BART's loop)."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x


class _Plain(nn.Module):
    """The same three Linears, always run."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_layerdrop_profiles_with_every_layer_and_says_so():
    """Each draw is the top of its range: no layer is skipped, whatever layerdrop (below 1), and the
    step costs what the same model without LayerDrop does."""
    plain = profile_model(_Plain(), (torch.randn(4, 16),), precision="fp32")
    for layerdrop in (0.0, 0.9):
        profile = profile_model(_LayerDrop(layerdrop), (torch.randn(4, 16),), precision="fp32")
        assert profile.fwd_flops == plain.fwd_flops == 3 * 2 * 4 * 16 * 16
        assert any("3 random scalars drawn in the step (LayerDrop's)" in note for note in profile.notes)
    assert not any("random scalars" in note for note in plain.notes)


def test_a_fake_mask_that_pads_nothing_lets_sdpa_run_causal():
    """transformers' own check, on a fake mask of ones: it keeps the mask on fake tensors (it cannot
    read them), where a real step of the batch drops it; within ValueReads it drops it too."""
    from transformers import masking_utils

    with FakeTensorMode():
        mask = torch.ones(2, 8, dtype=torch.bool)
        assert not masking_utils._ignore_causal_mask_sdpa(mask, 8, 8, 0, 0)
        with ValueReads() as reads:
            assert masking_utils._ignore_causal_mask_sdpa(mask, 8, 8, 0, 0)
    assert reads.masks == 1 and "pads nothing" in reads.note()
    assert masking_utils._ignore_causal_mask_sdpa(torch.ones(2, 8, dtype=torch.bool), 8, 8, 0, 0)


def test_a_draw_of_any_other_size_is_left_alone():
    """Only a one-element draw is a branch's: a size given by keyword counts too."""
    with FakeTensorMode(), ValueReads() as reads:
        assert torch.rand(size=(4, 4)).shape == (4, 4) and torch.rand(2, 3).shape == (2, 3)
        assert torch.rand(size=(1,)).constant is not None
    assert reads.draws == 1


def test_the_padding_warning_reads_no_fake_tokens():
    """transformers 4.x's warn_if_padding_and_no_attention_mask reads the first and last tokens
    (GPT-2's profile failed on it); on fake tokens it is skipped, on real ones it runs. While
    ValueReads is entered the model class's own method is the skipping one, and after it is back."""
    from transformers.modeling_utils import PreTrainedModel

    from stratagem.advisor.profile.value_reads import _unwarned

    original = PreTrainedModel.warn_if_padding_and_no_attention_mask
    with ValueReads():
        assert PreTrainedModel.warn_if_padding_and_no_attention_mask.__wrapped__ is original
    assert PreTrainedModel.warn_if_padding_and_no_attention_mask is original
    reads = []
    warn = _unwarned(lambda model, tokens, mask: reads.append(bool(tokens[:, [-1, 0]].eq(0).any())))
    with FakeTensorMode():
        assert warn(None, torch.zeros(2, 8, dtype=torch.long), None) is None
    warn(None, torch.zeros(2, 8, dtype=torch.long), None)
    assert reads == [True]
