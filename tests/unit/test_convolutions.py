"""Convolutions as cuDNN runs them: the shapes the profile records, their implicit GEMMs at the
shape model's efficiency or the calibrated rates, and the layout transforms an NCHW model pays on
an NVIDIA GPU (docs/cost-model.md, "Rates")."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from stratagem.advisor.calibrate.calibration import Calibration
from stratagem.advisor.calibrate.convolutions import QUICK_CONV_SHAPES, conv_rates
from stratagem.advisor.cost.convolutions import (
    arithmetic_intensity,
    conv_gemms,
    forward_flops,
    inductor_runs_channels_last,
    layout_transform_bytes,
)
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rates import (
    MEMORY_BANDWIDTH_EFFICIENCY,
    block_matmul_efficiency,
    gemm_efficiency,
    large_gemm_rate,
)
from stratagem.advisor.cost.stages import whole_model
from stratagem.advisor.cost.timing import estimate_time
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.advisor.profile.cache import PROFILE_BATCH, profile_spec
from stratagem.advisor.profile.model_profile import ConvLayer, ModelProfile, SegmentProfile
from stratagem.advisor.profile.profiler import profile_model
from stratagem.advisor.search.advice import advise
from stratagem.plan import Plan, Workload
from stratagem.units import format_seconds

from calibrations import bare_calibration

H100 = "1xH100-SXM-80GB"


def _conv(cin: int, cout: int, side: int, resolution: int, *, batch: int = 256, stride: int = 1,
          groups: int = 1, **fields) -> ConvLayer:
    positions = batch * resolution * resolution
    return ConvLayer(name="conv", in_channels=cin, out_channels=cout, kernel=(side, side), stride=(stride, stride),
                     groups=groups, rows=positions // stride**2, input_rows=positions, **fields)


def _segment(name: str, convs: tuple[ConvLayer, ...] = (), **counts) -> SegmentProfile:
    flops = sum(forward_flops(c) for c in convs)
    values = dict(num_params=0, param_bytes=0, buffer_bytes=0, fwd_flops=flops, bwd_flops=2 * flops,
                  saved_bytes=0, saved_param_copy_bytes=0, attention_fwd_flops=0, attention_saved_bytes=0,
                  input_bytes=0, output_bytes=0)
    return SegmentProfile(name=name, kind="Block" if convs else name, convs=convs, **{**values, **counts})


def _one_block(*convs: ConvLayer, batch: int = 256, **counts) -> ModelProfile:
    """A profile of one block of ``convs``, taken at ``batch`` images."""
    return ModelProfile(name="convs", precision="bf16-mixed", batch_size=batch, seq_len=None,
                        embed=_segment("embed"), blocks=(_segment("layers.0", convs, **counts),),
                        head=_segment("head"), block_container="layers")


def _efficiency(profile: ModelProfile, cluster: Cluster, batch: int = 256) -> float:
    return block_matmul_efficiency(profile, Plan(micro_batch_size=batch), whole_model(profile), [],
                                   cluster=cluster)


def _h100_shape() -> dict:
    cluster = parse_cluster(H100)
    device = cluster.device
    return dict(sms=device.num_sms, element_bytes=2,
                flops_per_second=large_gemm_rate(cluster, "bf16-mixed"),
                bytes_per_second=device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


# -- what the profile records ------------------------------------------------------------------

def test_the_profile_records_every_convolution_of_a_small_cnn():
    """resnet-tiny: a 7×7 stem at stride 2 on 64×64 images, then four bottlenecks (1×1, 3×3 with
    the stride, 1×1, a 1×1 downsample), every count at the profiled batch; the blocks' FLOPs are
    their convolutions' alone."""
    profile = profile_spec("resnet-tiny")
    (stem,) = profile.embed.convs
    assert (stem.name, stem.in_channels, stem.out_channels, stem.kernel, stem.stride) == ("stem.0", 3, 8, (7, 7), (2, 2))
    assert (stem.rows, stem.input_rows, stem.input_grad, stem.channels_last) == (
        PROFILE_BATCH * 32 * 32, PROFILE_BATCH * 64 * 64, False, False)
    second = profile.blocks[1].convs
    assert [c.name for c in second] == ["conv1", "conv2", "conv3", "downsample.0"]
    assert [(c.in_channels, c.out_channels, c.kernel, c.stride) for c in second] == [
        (32, 16, (1, 1), (1, 1)), (16, 16, (3, 3), (2, 2)), (16, 64, (1, 1), (1, 1)), (32, 64, (1, 1), (2, 2))]
    assert [c.rows // PROFILE_BATCH for c in second] == [256, 64, 64, 64]  # 16² then 8² positions
    assert all(c.input_grad for b in profile.blocks for c in b.convs)
    for block in profile.blocks:
        assert sum(forward_flops(c) for c in block.convs) == block.fwd_flops
    assert ModelProfile.from_dict(profile.to_dict()) == profile


def test_a_channels_last_model_is_profiled_channels_last():
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    images = torch.randn(2, 3, 16, 16)
    nchw = profile_model(model, (images,))
    nhwc = profile_model(model.to(memory_format=torch.channels_last),
                         (images.to(memory_format=torch.channels_last),))
    layouts = [[c.channels_last for s in p.segments for c in s.convs] for p in (nchw, nhwc)]
    assert layouts == [[False] * 3, [True] * 3] and nhwc.fwd_flops == nchw.fwd_flops
    assert all(layout_transform_bytes(s, element_bytes=2, compiled=False) == (0, 0) for s in nhwc.segments)


# -- implicit GEMMs ----------------------------------------------------------------------------

def test_a_convolution_runs_at_gemm_efficiency_at_its_implicit_gemms_dims():
    """A 1×1 convolution's implicit GEMMs are plain GEMMs: M = N·H·W positions, N = C_out, K = C_in;
    forward, input gradient and weight gradient weighted by their FLOPs as their times add."""
    conv = _conv(256, 64, 1, 56)
    m, n, k = 256 * 56 * 56, 64, 256
    assert [g[:3] for g in conv_gemms(conv, 1.0)] == [(m, n, k), (m, k, n), (k, n, m)]
    shape = _h100_shape()
    times = sum(1 / gemm_efficiency(*dims, **shape) for dims in ((m, n, k), (m, k, n), (k, n, m)))
    assert _efficiency(_one_block(conv), parse_cluster(H100)) == pytest.approx(3 / times)


def test_a_window_is_gathered_on_chip_not_streamed_from_memory():
    """A 3×3 convolution's K is nine times its input channels, but its implicit GEMM streams its
    input once, not the nine-times larger window matrix: faster than the explicit GEMM of its dims."""
    conv = _conv(64, 64, 3, 56)
    forward = next(conv_gemms(conv, 1.0))
    shape = _h100_shape()
    assert forward.moved < forward.m * forward.k
    implicit = gemm_efficiency(forward.m, forward.n, forward.k, moved=forward.moved, **shape)
    assert implicit > gemm_efficiency(forward.m, forward.n, forward.k, **shape)


def test_a_thin_convolution_is_less_efficient_than_a_wide_one():
    """ResNet-50's first-stage 1×1 (64 channels at 56²) is bound by memory; its last stage's 3×3
    (512 channels at 7²) computes near the large-GEMM rate."""
    cluster = parse_cluster(H100)
    thin = _efficiency(_one_block(_conv(64, 64, 1, 56)), cluster)
    wide = _efficiency(_one_block(_conv(512, 512, 3, 7)), cluster)
    assert thin < 0.3 < 0.8 < wide <= 1


def test_a_depthwise_convolution_is_one_kernel_over_every_channel():
    depthwise = _conv(96, 96, 7, 56, groups=96)
    (forward, *_) = conv_gemms(depthwise, 1.0)
    assert (forward.n, forward.k, forward.batch) == (96, 49, 1)
    grouped = next(conv_gemms(_conv(128, 128, 3, 28, groups=32), 1.0))  # ResNeXt's: a GEMM per group
    assert (grouped.n, grouped.k, grouped.batch) == (4, 36, 32)


def test_calibrated_convolutions_run_at_the_rate_measured_for_their_intensity():
    """With a calibrated convolution curve, a convolution's GEMMs run at its rate for their FLOPs
    per byte (interpolated in log intensity; in proportion below the least intense point, where
    memory binds); without one, at the matmul curve's rate for a square GEMM of the same size."""
    conv = _conv(64, 64, 3, 56)
    profile = _one_block(conv)
    cluster = parse_cluster(H100)
    largest = 700e12
    curve = ((100.0, 100e12), (1000.0, 500e12))
    node = dataclasses.replace(cluster.node, matmul_curve=(("bf16", 1024, 300e12), ("bf16", 8192, largest)),
                               conv_curve=tuple(("bf16", *point) for point in curve))
    calibrated = dataclasses.replace(cluster, node=node)
    plan = Plan(micro_batch_size=256)
    intensity = arithmetic_intensity(conv, 1.0, 2)
    assert 100 < intensity < 1000
    expected = 100e12 + 400e12 * math.log(intensity / 100) / math.log(10)
    matmul = [(1024, 300e12), (8192, largest)]
    measured = block_matmul_efficiency(profile, plan, whole_model(profile), matmul, cluster=calibrated)
    assert measured == pytest.approx(expected / largest, rel=1e-6)
    thin = _one_block(_conv(64, 64, 1, 56))
    below = arithmetic_intensity(thin.blocks[0].convs[0], 1.0, 2)
    assert block_matmul_efficiency(thin, plan, whole_model(thin), matmul, cluster=calibrated) == pytest.approx(
        100e12 * below / 100 / largest)
    uncalibrated_convs = dataclasses.replace(calibrated, node=dataclasses.replace(node, conv_curve=()))
    by_matmuls = block_matmul_efficiency(profile, plan, whole_model(profile), matmul, cluster=uncalibrated_convs)
    side = (256 * 56 * 56 * 64 * 576) ** (1 / 3)  # a square GEMM of one implicit GEMM's size: n ≈ 3094
    assert by_matmuls == pytest.approx((300e12 + 400e12 * math.log(side / 1024) / math.log(8)) / largest)


def test_a_calibration_carries_its_convolution_rates_to_the_cluster(tmp_path):
    calibration = bare_calibration(hardware="x", backend="gloo", matmul={"fp32": ((128, 1e11),)},
                                   memory_bandwidth=1e10, conv={"fp32": ((25.0, 8e10), (200.0, 1.5e11))})
    path = tmp_path / "c.json"
    calibration.save(path)
    assert Calibration.load(path) == calibration
    applied = calibration.apply(parse_cluster("2xcpu"))
    assert applied.node.conv_curve == (("fp32", 25.0, 8e10), ("fp32", 200.0, 1.5e11))
    older = calibration.to_dict()
    del older["conv"]  # taken before convolutions were measured: they run at the matmul curve's rates
    assert Calibration.from_dict(older).conv == {}


def test_the_convolution_benchmark_measures_rates_by_intensity(one_rank):
    rates = conv_rates(["fp32"], torch.device("cpu"), batch=1, repeats=1, shapes=QUICK_CONV_SHAPES)
    (points,) = rates.values()
    assert len(points) == 2 and points == sorted(points) and all(rate > 0 for _, rate in points)


# -- layout transforms -------------------------------------------------------------------------

def test_an_nchw_convolution_pays_its_transforms_each_way():
    """Forward: the input to NHWC and the output back, each read and written. Backward: the
    output's gradient and the input's (data gradient), the input and the output's gradient (weight
    gradient); the first convolution, whose input needs no gradient, skips the data gradient's."""
    conv = _conv(64, 256, 1, 56, batch=2)
    source, output = 2 * 56 * 56 * 64 * 2, 2 * 56 * 56 * 256 * 2
    segment = _segment("layers.0", (conv,))
    assert layout_transform_bytes(segment, element_bytes=2, compiled=False) == (
        2 * (source + output), 4 * (source + output))
    first = _segment("embed", (dataclasses.replace(conv, input_grad=False),))
    assert layout_transform_bytes(first, element_bytes=2, compiled=False) == (
        2 * (source + output), 2 * (source + output))


def test_a_compiled_block_transforms_at_its_boundary_where_inductor_lays_it_out_channels_last():
    wide = (_conv(256, 128, 1, 28), _conv(128, 128, 3, 28), _conv(128, 512, 1, 28))
    segment = _segment("layers.0", wide, input_bytes=1000, output_bytes=3000)
    assert inductor_runs_channels_last(wide)
    assert layout_transform_bytes(segment, element_bytes=2, compiled=True) == (8000, 8000)
    grouped = (_conv(128, 128, 3, 28, groups=32),)  # ResNeXt's: inductor leaves the layout
    small = (_conv(16, 16, 3, 28),)  # every convolution of at most 64 channels
    assert not inductor_runs_channels_last(grouped) and not inductor_runs_channels_last(small)
    eager = layout_transform_bytes(_segment("layers.0", grouped), element_bytes=2, compiled=False)
    assert layout_transform_bytes(_segment("layers.0", grouped), element_bytes=2, compiled=True) == eager


def test_only_16_bit_convolutions_on_nvidia_gpus_pay_transforms():
    profile = profile_spec("resnet-tiny")

    def layout(cluster: str, precision: str) -> float:
        workload = Workload(global_batch_size=2, precision=precision)
        return sum(rank_step(profile, cluster=parse_cluster(cluster), workload=workload,
                             plan=Plan(micro_batch_size=2, precision=precision)).layout_bytes.values())

    assert layout(H100, "bf16-mixed") > 0
    assert layout(H100, "fp32") == layout("1xcpu", "bf16-mixed") == 0
    gpt2 = profile_spec("gpt2-tiny")
    step = rank_step(gpt2, cluster=parse_cluster(H100), plan=Plan(micro_batch_size=2),
                     workload=Workload(global_batch_size=2, seq_len=gpt2.seq_len))
    assert set(step.layout_bytes.values()) == {0.0}  # no convolution: nothing changes


# -- ResNet-50 on one H100 ---------------------------------------------------------------------

def _without_convs(profile: ModelProfile) -> ModelProfile:
    """``profile`` as the cost model saw it before convolutions and BatchNorms were recorded: their
    FLOPs at the large-GEMM rate, no layout transform and BatchNorm by its operators' bytes."""
    def strip(segment: SegmentProfile) -> SegmentProfile:
        return dataclasses.replace(segment, convs=(), batch_norms=())

    variant = profile.in_compute_dtype and _without_convs(profile.in_compute_dtype)
    return dataclasses.replace(profile, embed=strip(profile.embed), blocks=tuple(map(strip, profile.blocks)),
                               head=strip(profile.head), in_compute_dtype=variant)


def test_resnet50_on_an_h100_pays_for_thin_convolutions_and_nchw_transforms():
    """Measured on one H100 (bf16 autocast, AdamW, 256 images): 116 ms a step, where FLOPs at the
    large-GEMM rate and the bytes of BatchNorm, ReLU and the residual adds predicted 40 ms. The
    implicit GEMMs' shapes (thin, memory-bound early convolutions), the NCHW↔NHWC transforms and
    BatchNorm's per-channel kernels all move the prediction up; a channels-last model would pay
    the GEMMs and BatchNorm's extra passes but neither the transforms nor the per-channel kernels'
    latency."""
    profile = profile_spec("resnet-50")
    cluster, workload = parse_cluster(H100), Workload(global_batch_size=256)
    plan = Plan(micro_batch_size=256, block_container=profile.block_container)
    before = estimate_time(_without_convs(profile), cluster=cluster, workload=workload, plan=plan).step_seconds
    step = rank_step(profile, cluster=cluster, workload=workload, plan=plan)
    after = estimate_time(profile, cluster=cluster, workload=workload, plan=plan).step_seconds
    assert 0.3 < step.block_matmul_efficiency < 0.7
    transforms = sum(step.layout_bytes[d, False] for d in ("fwd", "bwd")) * step.batch_scale * step.seconds_per_op_byte
    norms = sum(step.norm_seconds[d, False] for d in ("fwd", "bwd")) * step.batch_scale
    assert 0.035 < before < 0.045 and after > before + transforms + norms > before + transforms > before
    channels_last = profile.in_channels_last()
    nhwc = estimate_time(channels_last, cluster=cluster, workload=workload, plan=plan).step_seconds
    passes = rank_step(channels_last, cluster=cluster, workload=workload, plan=plan)
    passes = sum(passes.norm_seconds[d, False] for d in ("fwd", "bwd")) * step.batch_scale
    assert 0 < passes < norms / 3 and nhwc == pytest.approx(after - transforms - norms + passes)



def test_the_advice_says_what_channels_last_would_save_an_nchw_network():
    """ResNet-50 on an H100 in bf16: the best plan, eager or compiled, costed again on the profile
    laid out channels-last, in the notes; not for a model without convolutions, one already
    channels-last, nor where cuDNN transforms nothing (fp32, CPU ranks)."""
    profile, h100, workload = profile_spec("resnet-50"), parse_cluster(H100), Workload(global_batch_size=256)
    for constraints in ({}, {"compile": False}):
        advice = advise(profile, h100, workload, top=1, constraints=constraints)
        (note,) = [n for n in advice.notes if "channels-last" in n]
        best = advice.best
        faster = estimate_time(profile.in_channels_last(), cluster=h100, workload=workload, plan=best.plan)
        assert f"{best.plan.name} is predicted at {format_seconds(faster.step_seconds)} a step" in note
        assert "BatchNorms run ATen's slower NCHW kernels" in note and "torch.channels_last" in note
    quiet = [advise(profile.in_channels_last(), h100, workload, top=1),
             advise(profile, h100, Workload(global_batch_size=256, precision="fp32"), top=1),
             advise(profile, parse_cluster("2xcpu"), Workload(global_batch_size=4), top=1),
             advise(profile_spec("vit-tiny"), h100, Workload(global_batch_size=256), top=1)]
    assert not [n for advice in quiet for n in advice.notes if "channels-last" in n]
