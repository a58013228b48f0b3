"""FLOPs of recurrent layers: the CPU's LSTM runs oneDNN's fused layer (``aten.mkldnn_rnn_layer``)
and CUDA's RNNs cuDNN's (``aten._cudnn_rnn``), which torch's counter does not count; the profile
counts their GEMMs from the weights' shapes (``flop_formulas``) as the decomposition would."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from stratagem.advisor.profile.flop_formulas import FLOP_FORMULAS
from stratagem.advisor.profile.profiler import profile_model

BATCH, STEPS, WIDTH, HIDDEN = 3, 5, 16, 8


class _Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _hand_count(rnn: nn.RNNBase, tokens: int) -> int:
    """2 FLOPs per multiply-add of x·W_ihᵀ, h·W_hhᵀ (and h·W_hrᵀ) per token, layer and direction."""
    return 2 * tokens * sum(w.numel() for w in rnn._flat_weights if w.dim() == 2)


def _lstm_hand_count(rnn: nn.LSTM, tokens: int) -> int:
    """The same from the LSTM's sizes: 4 gates of [4H, I] and [4H, H] a layer and direction (of
    [4H, P] and a projection [P, H] with proj_size P); a deeper layer's input is every direction's."""
    directions, out = 1 + rnn.bidirectional, rnn.proj_size or rnn.hidden_size
    macs = 0
    for layer in range(rnn.num_layers):
        inputs = rnn.input_size if layer == 0 else out * directions
        macs += directions * (4 * rnn.hidden_size * (inputs + out) + rnn.proj_size * rnn.hidden_size)
    return 2 * macs * tokens


def _profile(rnn: nn.RNNBase, precision: str = "fp32"):
    return profile_model(_Recurrent(rnn), (torch.randn(BATCH, STEPS, WIDTH),), precision=precision,
                         loss_fn=lambda out: out.sum())


LSTMS = {
    "lstm": dict(num_layers=2),
    "bidirectional": dict(num_layers=2, bidirectional=True),
    "projected": dict(num_layers=2, bidirectional=True, proj_size=4),  # runs the decomposition on CPU
}


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("options", LSTMS.values(), ids=LSTMS.keys())
def test_an_lstm_counts_its_gemms_forward_and_twice_that_backward(options):
    rnn = nn.LSTM(WIDTH, HIDDEN, batch_first=True, **options)
    forward = _lstm_hand_count(rnn, BATCH * STEPS)
    assert forward == _hand_count(rnn, BATCH * STEPS)
    profile = _profile(rnn)
    assert profile.fwd_flops == forward
    if not rnn.proj_size:  # oneDNN's backward computes every gradient, the initial state's too
        assert profile.bwd_flops == 2 * forward


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_the_fused_layer_counts_what_its_decomposition_would_forward():
    rnn = nn.LSTM(WIDTH, HIDDEN, num_layers=2, bidirectional=True, batch_first=True)
    fused = _profile(rnn)
    with torch.backends.mkldnn.flags(enabled=False):
        decomposed = _profile(rnn)
    assert fused.fwd_flops == decomposed.fwd_flops == _lstm_hand_count(rnn, BATCH * STEPS)


def test_a_gru_is_counted_by_torch_as_before():
    rnn = nn.GRU(WIDTH, HIDDEN, num_layers=2, batch_first=True)
    assert _profile(rnn).fwd_flops == _hand_count(rnn, BATCH * STEPS)


@pytest.mark.parametrize("options", LSTMS.values(), ids=LSTMS.keys())
def test_cudnn_s_rnn_counts_every_layer_and_direction_from_its_weight_list(options):
    rnn = nn.LSTM(WIDTH, HIDDEN, **options)
    directions, out = 1 + rnn.bidirectional, rnn.proj_size or HIDDEN
    shapes = [w.shape for w in rnn._flat_weights]
    with FakeTensorMode(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        x = torch.empty(STEPS, BATCH, WIDTH, device="cuda")
        weights = [torch.empty(shape, device="cuda") for shape in shapes]
        hx = torch.empty(rnn.num_layers * directions, BATCH, out, device="cuda")
        cx = torch.empty(rnn.num_layers * directions, BATCH, HIDDEN, device="cuda")
        # as aten/src/ATen/native/cudnn/RNN.cpp's _cudnn_impl calls it: mode 2 is the LSTM
        torch.ops.aten._cudnn_rnn(x, weights, 4 + bool(rnn.proj_size), None, hx, cx, 2, HIDDEN, rnn.proj_size,
                                  rnn.num_layers, False, 0.0, True, rnn.bidirectional, [], None)
    forward = _lstm_hand_count(rnn, BATCH * STEPS)
    assert counter.get_total_flops() == forward
    backward = FLOP_FORMULAS[torch.ops.aten._cudnn_rnn_backward]
    args = [(STEPS, BATCH, WIDTH), shapes, *[None] * 19]
    assert backward(*args[:21], [True, True, True, True]) == 2 * forward
    assert backward(*args[:21], [True, True, True, False]) == forward  # frozen weights: no dW
