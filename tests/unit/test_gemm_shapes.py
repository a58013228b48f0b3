"""GEMMs by shape on GPUs no calibration measured: tiles, waves, split-K and the memory roofline,
and what they make of models of different sizes."""

from __future__ import annotations

import pytest

from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rates import FP32_GEMM_FRACTION, block_matmul_efficiency, gemm_efficiency
from stratagem.advisor.cost.stages import whole_model
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.hardware.catalog import MAMF_SUSTAINED
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload

A100 = dict(sms=108, element_bytes=2, flops_per_second=267.9e12, bytes_per_second=2.039e12 * 0.7)


def test_large_gemms_reach_the_measured_rate_and_small_ones_do_not():
    assert gemm_efficiency(8192, 8192, 8192, **A100) == pytest.approx(1.0, abs=0.01)
    assert gemm_efficiency(2048, 2048, 2048, **A100) < gemm_efficiency(4096, 4096, 4096, **A100) < 1
    assert gemm_efficiency(512, 512, 512, **A100) < 0.3


def test_one_tile_more_than_the_sms_costs_a_second_wave():
    full = gemm_efficiency(108 * 128, 256, 8192, **A100)  # 108 tiles of 128 × 256: one wave
    spill = gemm_efficiency(109 * 128, 256, 8192, **A100)
    assert full == pytest.approx(1.0, abs=0.01) and spill < 0.7  # the best tile leaves a third idle


def test_too_few_tiles_split_along_k():
    # a weight gradient: a 768 × 3072 output over 16,384 rows, 72 tiles for 108 SMs
    assert gemm_efficiency(768, 3072, 16384, **A100) == pytest.approx(1.0, abs=0.01)
    assert gemm_efficiency(768, 3072, 512, **A100) < 0.7  # too short a k to split


def test_a_thin_gemm_is_bound_by_memory():
    thin = gemm_efficiency(8, 8192, 8192, **A100)
    streamed = 2 * 8 * 8192 * 8192 / 267.9e12 / ((8 * 8192 + 8192 * 8192 + 8 * 8192) * 2 / (2.039e12 * 0.7))
    assert thin == pytest.approx(streamed)


def test_larger_models_run_their_blocks_closer_to_the_rate():
    """Megatron-LM's README: MFU rises with model size because larger GEMMs have higher arithmetic
    intensity. A100 rate and SMs from the catalog; each model at 8 × 2048 tokens."""
    cluster = parse_cluster("1xA100-SXM4-80GB")
    efficiency = {}
    for name in ("gpt2", "llama-2-7b"):
        profile = profile_spec(name, seq_len=1024)
        plan = Plan(micro_batch_size=8)
        efficiency[name] = block_matmul_efficiency(profile, plan, whole_model(profile), [], cluster=cluster)
    assert 0.5 < efficiency["gpt2"] < efficiency["llama-2-7b"] <= 1


def test_an_uncalibrated_gpu_computes_at_its_largest_gemms_measured_rate():
    """The H100 SXM's best shape found (Bekman's MAMF, 792.1 TFLOP/s) at the share a step's large
    GEMMs sustain."""
    profile = profile_spec("llama-tiny")
    step = rank_step(profile, cluster=parse_cluster("1xH100"), plan=Plan(),
                     workload=Workload(global_batch_size=1, seq_len=profile.seq_len))
    assert step.flops_per_second == pytest.approx(792.1e12 * MAMF_SUSTAINED) and step.block_matmul_efficiency < 1
    fp32 = rank_step(profile, cluster=parse_cluster("1xH100"), plan=Plan(precision="fp32"),
                     workload=Workload(global_batch_size=1, seq_len=profile.seq_len, precision="fp32"))
    assert fp32.flops_per_second == pytest.approx(FP32_GEMM_FRACTION * 67e12)  # CUDA cores: not the 16-bit share
    cpu = rank_step(profile, cluster=parse_cluster("2xcpu"), plan=Plan(dp_replicate=2),
                    workload=Workload(global_batch_size=2, seq_len=profile.seq_len))
    assert cpu.block_matmul_efficiency == 1.0  # no shapes model on CPU ranks
