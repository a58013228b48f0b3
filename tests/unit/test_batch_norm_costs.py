"""BatchNorm's kernels on a GPU: what the profile records of each BatchNorm, which ones run on ATen's
kernels, what the per-channel (NCHW) ones cost against their times measured on one H100, and the
memory latency that bounds them, catalogued, calibrated or noted as unknown."""

from __future__ import annotations

import dataclasses

import pytest

from stratagem.advisor.calibrate.calibration import Calibration, hardware_key
from stratagem.advisor.cost.batch_norm import aten_seconds, latency_unknown_note, nchw_kernel_seconds, runs_aten_kernels
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rates import seconds_per_op_byte
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.model_profile import BatchNormCall
from stratagem.plan import Plan, Workload

from calibrations import bare_calibration

H100 = "1xH100-SXM-80GB"
IMAGES = 256
# ATen's kernels on one H100 SXM5 80GB, bfloat16 NCHW at 256 images, ResNet-50's shapes
# (bench/batch_norm_rate.py, 2026-11-26): (channels, side) -> (statistics kernel ms or None where
# it was not among the two slowest, backward kernel ms). The catalog's latency comes from the first
# statistics kernel alone; every other time here is one it was not taken from.
MEASURED_MS = {(64, 112): (2.62, 5.75), (256, 56): (0.76, 1.84), (512, 28): (None, 0.64), (1024, 14): (None, 0.34),
               (2048, 7): (None, 0.17)}


def _call(channels: int, side: int, *, dtype: str = "bfloat16", weight: str | None = "float32",
          channels_last: bool = False) -> BatchNormCall:
    return BatchNormCall(channels=channels, elements=IMAGES * channels * side * side, dtype=dtype,
                         weight_dtype=weight, channels_last=channels_last)


def test_the_profile_records_each_batch_norm_on_batch_statistics():
    profile = profile_spec("resnet-tiny", precision="bf16-mixed")
    calls = [call for segment in profile.segments for call in segment.batch_norms]
    convs = [conv for segment in profile.segments for conv in segment.convs]
    assert len(calls) == len(convs)  # every convolution of a ResNet is followed by its BatchNorm
    stem = profile.embed.batch_norms[0]
    assert (stem.dtype, stem.weight_dtype, stem.channels_last) == ("bfloat16", "float32", False)
    assert stem.elements == profile.embed.convs[0].rows * stem.channels  # the stem convolution's output
    assert not profile_spec("gpt2-tiny", seq_len=32).blocks[0].batch_norms  # LayerNorm is not one


@pytest.mark.parametrize(("call", "cluster", "aten"), [
    (_call(64, 56), H100, True),  # bf16 autocast: a bf16 input, an fp32 weight
    (_call(64, 56, dtype="float16", weight="float16"), H100, True),
    (_call(64, 56, dtype="float16"), H100, False),  # fp16 with an fp32 weight: cuDNN's
    (_call(64, 56, dtype="float32"), H100, False),  # cuDNN's
    (_call(64, 56, dtype="float32", weight=None), H100, True),  # cuDNN's wants an affine weight and bias
    (_call(64, 56, channels_last=True), H100, True),  # ATen's channels-last kernels
    (_call(64, 56), "1xMI300X", False),  # ROCm's launch differs
    (_call(64, 56), "2xcpu", False),
])
def test_which_batch_norms_run_on_atens_kernels(call, cluster, aten):
    assert runs_aten_kernels(call, parse_cluster(cluster)) is aten


@pytest.mark.parametrize(("channels", "side"), list(MEASURED_MS))
def test_nchw_kernels_cost_what_they_took_on_an_h100(channels, side):
    """The statistics kernel and the backward's, each within 20 % of the time measured."""
    cluster = parse_cluster(H100)
    device, per_byte = cluster.device, seconds_per_op_byte(cluster)  # the catalog's: 0.7 of 3.35 TB/s
    call = _call(channels, side)
    statistics, backward = nchw_kernel_seconds(call, device, per_byte)
    measured_statistics, measured_backward = MEASURED_MS[channels, side]
    if measured_statistics is not None:
        assert statistics * 1e3 == pytest.approx(measured_statistics, rel=0.2)
    assert backward * 1e3 == pytest.approx(measured_backward, rel=0.2)


def test_few_channels_stream_slower_and_otherwise_the_extra_passes_alone_cost():
    """NCHW with few channels pays the latency; channels-last kernels, or an unknown latency, leave
    the statistics' pass forward and the reduction's two backward."""
    device, per_byte = parse_cluster(H100).device, 1e-12
    narrow, wide = (aten_seconds(_call(c, 56), device, per_byte) for c in (64, 1024))
    assert narrow[0] / (64 * 56**2) > 4 * wide[0] / (1024 * 56**2)  # per element, 64 channels fill half the SMs
    passes = pytest.approx((_call(64, 56).elements * 2 * per_byte, 2 * _call(64, 56).elements * 2 * per_byte))
    assert aten_seconds(_call(64, 56), dataclasses.replace(device, memory_latency=None), per_byte) == passes
    assert aten_seconds(_call(64, 56, channels_last=True), device, per_byte) == passes


def test_resnet_steps_pay_the_kernels_eager_and_not_where_inductor_compiles_the_blocks():
    profile = profile_spec("resnet-50", precision="bf16-mixed")
    workload = Workload(global_batch_size=IMAGES, precision="bf16-mixed")
    eager, compiled = (rank_step(profile, cluster=parse_cluster(H100), workload=workload,
                                 plan=Plan(micro_batch_size=IMAGES, compile=flag, precision="bf16-mixed",
                                           block_container=profile.block_container))
                       for flag in (False, True))
    # eager: tens of milliseconds (ATen's kernels took 61.4 of the 113.9 ms of device time of a
    # profiled step on an H100: docs/benchmarks.md, "BatchNorm in 16 bits")
    assert 0.03 < sum(eager.norm_seconds[d, False] for d in ("fwd", "bwd")) * eager.batch_scale < 0.06
    assert compiled.norm_seconds["fwd", True] == compiled.norm_seconds["bwd", True] == 0.0
    assert compiled.norm_seconds["fwd", False] > 0  # the stem's BatchNorm stays eager


def test_a_gpu_without_a_known_latency_is_noted_and_one_calibrated_is_not():
    profile = profile_spec("resnet-tiny", precision="bf16-mixed")
    a100 = parse_cluster("1xA100-SXM4-80GB")
    (note,) = latency_unknown_note(profile, a100)
    assert "per-channel kernels" in note and "stratagem calibrate" in note
    assert latency_unknown_note(profile, parse_cluster(H100)) == ()
    assert latency_unknown_note(profile_spec("resnet-tiny", precision="fp32"), a100) == ()  # cuDNN's kernels
    measured = dataclasses.replace(_calibration(a100), memory_latency=450e-9)
    assert measured.apply(a100).device.memory_latency == 450e-9
    assert latency_unknown_note(profile, measured.apply(a100)) == ()
    older = {**measured.to_dict()}
    del older["memory_latency"]  # a calibration from before it was measured
    assert Calibration.from_dict(older).apply(a100).device.memory_latency is None


def _calibration(cluster: Cluster) -> Calibration:
    return bare_calibration(hardware=hardware_key(cluster), memory_bandwidth=1.5e12)
