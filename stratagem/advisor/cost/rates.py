"""The rates one rank works at: its device's dense peak in a precision, the share of it matmuls
reach at their shapes and alignment, and what a byte moved by an operator without FLOPs costs.

Uncalibrated, these are catalog figures times the fractions below; ``stratagem calibrate``
measures each on the cluster (docs/cost-model.md, "Calibration").
"""

from __future__ import annotations

import math

from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import LinearLayer, ModelProfile
from stratagem.plan import Plan
from stratagem.plan.precision import get_precision

# Share of the catalog's dense peak that profiled FLOPs reach uncalibrated. GPU: estimate from
# bf16 GEMMs at transformer shapes (60-75 % of peak); CPU: the catalog's per-core rate is achieved.
ACHIEVABLE_FLOPS_FRACTION = {"gpu": 0.6, "cpu": 1.0}

# Share of the aligned rate a GEMM with a leading dimension not a multiple of 16 bytes reaches.
# GPU: measured on an H200 by bench/gpu_phases.py (GPT-2's 50,257-wide head); CPU: 1.0.
UNALIGNED_MATMUL_FRACTION = {"gpu": 0.18, "cpu": 1.0}

# fp32 matmuls run in full fp32: torch.backends.cuda.matmul.allow_tf32 defaults to False (torch ≥ 1.12).
FP32_MATMUL_USES_TF32 = False

# Share of peak memory bandwidth a streaming kernel reaches (roofline, Williams et al. 2009). Estimate.
MEMORY_BANDWIDTH_EFFICIENCY = 0.7


def estimate_peak_flops(cluster: Cluster, *, precision: str) -> float:
    """Dense peak FLOP/s of one device in ``precision``'s compute dtype (fp32 as
    :data:`FP32_MATMUL_USES_TF32` says)."""
    return cluster.device.peak_flops(matmul_dtype(cluster, precision))


def achievable_fraction(cluster: Cluster, curve: list[tuple[int, float]]) -> float:
    """The share of the dense peak the largest matmuls reach: all of it where a calibrated
    ``curve`` measured it (its rates are achieved ones), else :data:`ACHIEVABLE_FLOPS_FRACTION`."""
    return 1.0 if curve else ACHIEVABLE_FLOPS_FRACTION[_kind(cluster)]


def matmul_dtype(cluster: Cluster, precision: str) -> str:
    """The device dtype ``precision``'s matmuls run in: ``fp32`` (``tf32`` as
    :data:`FP32_MATMUL_USES_TF32` says), ``bf16`` or ``fp16``."""
    dtype = get_precision(precision).compute_dtype
    if dtype == "float32":
        return "tf32" if FP32_MATMUL_USES_TF32 and cluster.device.peak_tf32 is not None else "fp32"
    return {"bfloat16": "bf16", "float16": "fp16"}[dtype]


def matmul_curve(cluster: Cluster, precision: str) -> list[tuple[int, float]]:
    """The calibrated (side, FLOP/s) of square matmuls in ``precision``'s matmul dtype, by side
    (``NodeSpec.matmul_curve``; empty uncalibrated)."""
    dtype = matmul_dtype(cluster, precision)
    return sorted((n, rate) for measured, n, rate in cluster.node.matmul_curve if measured == dtype)


def unaligned_matmul_fraction(cluster: Cluster, precision: str) -> float:
    """The share of the aligned rate GEMMs with unaligned matrices reach in ``precision``'s matmul
    dtype: as calibrated (``NodeSpec.unaligned_matmul``), else :data:`UNALIGNED_MATMUL_FRACTION`."""
    measured = dict(cluster.node.unaligned_matmul).get(matmul_dtype(cluster, precision))
    return measured if measured is not None else UNALIGNED_MATMUL_FRACTION[_kind(cluster)]


def seconds_per_op_byte(cluster: Cluster) -> float:
    """Seconds each byte an operator without FLOPs reads or writes costs: as calibrated
    (``NodeSpec.op_byte_seconds``), else at the device's memory bandwidth ×
    :data:`MEMORY_BANDWIDTH_EFFICIENCY`."""
    measured = cluster.node.op_byte_seconds
    if measured is not None:
        return measured
    return 1 / (cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)


def block_matmul_efficiency(profile: ModelProfile, plan: Plan, stage: Stage, curve: list[tuple[int, float]]) -> float:
    """The share of the peak rate the stage's blocks' Linears reach at their sizes, from a
    matmul curve (:func:`matmul_curve`; 1 without one), weighted by FLOPs as their times add.

    Each Linear's GEMM on one TP rank (its rows × input × output width, the split side divided by
    TP) runs at the curve's rate for a square matmul of the same FLOPs (``n³ = m·k·n``,
    interpolated in ``log n``, clamped at the measured ends), over the rate at the largest size.
    Its rows are those the profile saw (:func:`linear_rows`), else the block's tokens, from its
    FLOPs with the attention core set aside."""
    if not curve:
        return 1.0
    styles = plan.block_tp_styles if plan.tp > 1 else {}
    scale = plan.micro_batch_size / profile.batch_size
    flops = seconds = 0.0
    for block, count in stage.kinds:
        widths = sum(linear.in_features * linear.out_features for linear in block.linears)
        if not widths:
            continue
        per_sample = (block.fwd_flops - block.attention_fwd_flops) / (2 * widths) / profile.batch_size
        for linear in block.linears:
            style = styles.get(linear.name)
            inner = linear.in_features / (plan.tp if style == "rowwise" else 1)
            outer = linear.out_features / (plan.tp if style == "colwise" else 1)
            size = linear_rows(linear, scale, per_sample * plan.micro_batch_size) * inner * outer
            flops += count * size
            seconds += count * size / _interpolated_rate(curve, size ** (1 / 3))
    return flops / seconds / curve[-1][1] if seconds else 1.0


def linear_rows(linear: LinearLayer, batch_scale: float, tokens: float) -> float:
    """Rows ``linear`` multiplies per micro-batch: the profiled rows scaled by ``batch_scale``
    (micro-batch over profiled batch), or ``tokens`` where the profile recorded none."""
    return linear.rows * batch_scale if linear.rows else tokens


def _interpolated_rate(curve: list[tuple[int, float]], n: float) -> float:
    """The rate of a square matmul of side ``n`` on ``curve`` (sorted (side, FLOP/s)): linear in
    ``log n`` between measured sides, the end's rate beyond them."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (n0, r0), (n1, r1) in zip(curve, curve[1:]):
        if n <= n1:
            return r0 + (r1 - r0) * math.log(n / n0) / math.log(n1 / n0)
    return curve[-1][1]


def _kind(cluster: Cluster) -> str:
    # TPU chips take the GPU figures: accelerators the host runs ahead of (unmeasured on TPUs).
    return "gpu" if cluster.is_accelerator else "cpu"


# -- GEMMs by shape, on GPUs no calibration measured ------------------------------------------

# Output tiles cuBLAS's large 16-bit tensor-core kernels compute per thread block (NVIDIA, "Matrix
# Multiplication Background User's Guide": tile quantization with 256×128 and 128×128 tiles).
GEMM_TILES = ((256, 128), (128, 256), (128, 128))

# The fewest rows of the reduced dimension one split-K slice takes (cuBLAS splits a GEMM of too few
# tiles to fill the SMs along k). Estimate: one 128-row k-block per pipeline stage, a few stages.
SPLIT_K_MIN = 512


def gemm_efficiency(m: float, n: float, k: float, *, sms: int, element_bytes: int,
                    flops_per_second: float, bytes_per_second: float) -> float:
    """The share of ``flops_per_second`` (what the largest GEMMs reach) an ``m×k · k×n`` GEMM
    reaches on a GPU of ``sms`` streaming multiprocessors: its output padded to whole tiles
    (:data:`GEMM_TILES`, the best of them), the tiles run one per SM in waves, too few of them
    split along ``k`` (:data:`SPLIT_K_MIN`); and no faster than its operands and output stream
    from memory at ``bytes_per_second`` (roofline, Williams et al. 2009)."""
    if min(m, n, k) <= 0:
        return 1.0
    ideal = 2 * m * n * k / flops_per_second
    per_sm = flops_per_second / sms
    compute = min(_tiled_seconds(m, n, k, tile, sms=sms, per_sm=per_sm) for tile in GEMM_TILES)
    memory = (m * k + k * n + m * n) * element_bytes / bytes_per_second
    return ideal / max(compute, memory)


def _tiled_seconds(m: float, n: float, k: float, tile: tuple[int, int], *, sms: int, per_sm: float) -> float:
    """Seconds of a GEMM computed in ``tile``-sized output blocks, one per SM at a time, with
    the split along ``k`` (into slices of at least :data:`SPLIT_K_MIN`) that fills the waves best."""
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    most = max(1, min(math.ceil(sms / tiles) * 2, int(k // SPLIT_K_MIN))) if tiles < sms else 1
    waves = min(math.ceil(tiles * s / sms) / s for s in range(1, most + 1))  # in units of the whole k
    return waves * 2 * tile[0] * tile[1] * k / per_sm
