"""The rates one rank works at: its device's dense peak in a precision, the share of it matmuls
reach at their shapes and alignment, and what a byte moved by an operator without FLOPs costs.

Uncalibrated, these are catalog figures times the fractions below; ``stratagem calibrate``
measures each on the cluster (docs/cost-model.md, "Calibration").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

from stratagem.advisor.cost.attention import prices_fused_attention
from stratagem.advisor.cost.convolutions import ConvGemm, arithmetic_intensity, conv_gemms, forward_flops
from stratagem.advisor.cost.curves import log_interpolated
from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.hardware.catalog import MAMF_SUSTAINED
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import ConvLayer, LinearLayer, ModelProfile, SegmentProfile
from stratagem.plan import Plan
from stratagem.plan.precision import get_precision

# Share of the catalog's dense peak that profiled FLOPs reach uncalibrated, on accelerators whose
# GEMMs the shape model cannot treat (SMs not catalogued): estimate from bf16 GEMMs at transformer
# shapes (60-75 % of peak). CPU: oneDNN's GEMMs reach a core's vector peak at about its nominal
# clock (bench/cpu_rates.py: 0.98-1.25 of it on a Zen 4 host; docs/hardware.md, "CPU ranks").
ACHIEVABLE_FLOPS_FRACTION = {"gpu": 0.6, "cpu": 1.0}

# Share of the 16-bit dense peak the largest GEMMs of a step sustain on a GPU no measurement in the
# catalog covers: NVIDIA's data-center GPUs' best shapes reach 80-86 % (Bekman's MAMF table: A100
# SXM 85.9 %, A100 PCIe 82.2 %, H100 SXM 80.1 %, GH200 83.0 %), a step's large GEMMs
# MAMF_SUSTAINED of that. Estimate.
LARGE_GEMM_FRACTION = 0.8 * MAMF_SUSTAINED

# Share of the fp32 peak large fp32 GEMMs sustain on a GPU's CUDA cores (torch's default: no TF32),
# where the catalog's large-GEMM figure is a 16-bit tensor cores' and does not apply: measured by
# `stratagem calibrate` on two H100 SXM5, 51-52 TFLOP/s of 67 from n = 2,048
# (bench/calibrations/). Other chips: not measured.
FP32_GEMM_FRACTION = 0.78

# Share of the aligned rate a GEMM with a leading dimension not a multiple of 16 bytes reaches.
# GPU: measured on an H200 by bench/gpu_phases.py (GPT-2's 50,257-wide head); CPU: 1.0.
UNALIGNED_MATMUL_FRACTION = {"gpu": 0.18, "cpu": 1.0}

# fp32 matmuls run in full fp32: torch.backends.cuda.matmul.allow_tf32 defaults to False (torch ≥ 1.12).
FP32_MATMUL_USES_TF32 = False

# Share of the catalog's peak memory bandwidth a large copy reaches: `stratagem calibrate`'s copy
# on two H100 SXM5s (2.85 and 2.95 of 3.35 TB/s, bench/calibrations/) and an H200 (4.2 of 4.8).
COPY_BANDWIDTH_FRACTION = 0.87

# Share of peak memory bandwidth a step's memory-bound kernels reach, uncalibrated (roofline,
# Williams et al. 2009). A copy reaches COPY_BANDWIDTH_FRACTION; a whole step's operators without
# FLOPs 0.47-0.67 (their kernels' device time against the bytes the profile counts: GPT-2 large and
# ViT-L/16 compiled on an H100, ViT-B/16 and Llama 2 7B eager on an H200; docs/benchmarks.md, "GPU
# figures"), the models with biases and LayerNorm lowest: their gradients' sums over the tokens run
# below a copy's rate. A value between the two until those kinds are priced apart
# (bench/reduction_rate.py times them).
MEMORY_BANDWIDTH_EFFICIENCY = 0.7

# Share of a copy's rate a step's memory-bound kernels reach: the two figures above as one ratio,
# so that a calibrated accelerator, whose calibration times a copy and no step, prices them as the
# catalog path does rather than at the copy's rate.
MEMORY_BOUND_SHARE_OF_COPY = MEMORY_BANDWIDTH_EFFICIENCY / COPY_BANDWIDTH_FRACTION

# Device seconds between two kernels of one stream with the second launched already (the GPU's own
# gap from one kernel's end to the next one's start). GPU: measured on one H100 by
# bench/gpu_kernels.py under torch's profiler, compiled steps: 4.5 ms over 2,998 kernels (GPT-2
# large), 3.2 ms over 2,051 (ViT-L/16), 1.5-1.6 µs each (docs/benchmarks.md, "GPU figures"). CPU
# ranks run each operator as the host calls it (the host's time is the dispatch term's); a TPU
# runs the step as one compiled XLA program, not a kernel per operator.
KERNEL_GAP_SECONDS = 1.5e-6


def estimate_peak_flops(cluster: Cluster, *, precision: str) -> float:
    """Dense peak FLOP/s of one device in ``precision``'s compute dtype (fp32 as
    :data:`FP32_MATMUL_USES_TF32` says)."""
    return cluster.device.peak_flops(matmul_dtype(cluster, precision))


def achievable_fraction(cluster: Cluster, curve: list[tuple[int, float]], dtype: str) -> float:
    """The share of the dense peak the largest matmuls in ``dtype`` reach: all of it where a
    calibrated ``curve`` measured it (its rates are achieved ones); on a GPU the shape model treats
    (SMs catalogued: :func:`gemm_efficiency`), in 16 bits or TF32 the catalog's share or
    :data:`LARGE_GEMM_FRACTION`, in fp32 :data:`FP32_GEMM_FRACTION`; else
    :data:`ACHIEVABLE_FLOPS_FRACTION`, shapes folded in."""
    if curve:
        return 1.0
    if cluster.is_accelerator and cluster.device.num_sms:
        if dtype == "fp32":
            return FP32_GEMM_FRACTION
        return cluster.device.matmul_fraction or LARGE_GEMM_FRACTION
    return ACHIEVABLE_FLOPS_FRACTION[_kind(cluster)]


def large_gemm_rate(cluster: Cluster, precision: str) -> float:
    """FLOP/s the largest matmuls in ``precision``'s matmul dtype reach on one device: the dense
    peak times :func:`achievable_fraction` (the calibrated curve's largest rate where measured)."""
    dtype = matmul_dtype(cluster, precision)
    return achievable_fraction(cluster, matmul_curve(cluster, precision), dtype) * cluster.device.peak_flops(dtype)


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


def conv_curve(cluster: Cluster, precision: str) -> list[tuple[float, float]]:
    """The calibrated (FLOPs per byte, FLOP/s) of convolutions in ``precision``'s matmul dtype, by
    arithmetic intensity (``NodeSpec.conv_curve``; empty uncalibrated)."""
    dtype = matmul_dtype(cluster, precision)
    return sorted((intensity, rate) for measured, intensity, rate in cluster.node.conv_curve if measured == dtype)


def unaligned_matmul_fraction(cluster: Cluster, precision: str) -> float:
    """The share of the aligned rate GEMMs with unaligned matrices reach in ``precision``'s matmul
    dtype: as calibrated (``NodeSpec.unaligned_matmul``), else :data:`UNALIGNED_MATMUL_FRACTION`."""
    measured = dict(cluster.node.unaligned_matmul).get(matmul_dtype(cluster, precision))
    return measured if measured is not None else UNALIGNED_MATMUL_FRACTION[_kind(cluster)]


def seconds_per_op_byte(cluster: Cluster) -> float:
    """Seconds each byte an operator without FLOPs reads or writes costs: as calibrated
    (``NodeSpec.op_byte_seconds``: on CPU ranks a reference step's, on an accelerator a copy's,
    of which its step's kernels reach :data:`MEMORY_BOUND_SHARE_OF_COPY`), else at the device's
    memory bandwidth × :data:`MEMORY_BANDWIDTH_EFFICIENCY`."""
    measured = cluster.node.op_byte_seconds
    if measured is None:
        return 1 / (cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
    return measured / MEMORY_BOUND_SHARE_OF_COPY if cluster.is_accelerator else measured


def flops_per_moved_byte(cluster: Cluster, precision: str) -> float:
    """The FLOPs the device's largest GEMMs run (:func:`large_gemm_rate`) in the time operators
    without FLOPs move one byte (:func:`seconds_per_op_byte`): what a byte moved weighs against a
    FLOP where pipeline stages are balanced (:mod:`~stratagem.advisor.search.partition`)."""
    return large_gemm_rate(cluster, precision) * seconds_per_op_byte(cluster)


def block_matmul_efficiency(profile: ModelProfile, plan: Plan, stage: Stage, curve: list[tuple[int, float]], *,
                            cluster: Cluster | None = None) -> float:
    """The share of the rank's matmul rate the stage's blocks' GEMMs reach at their shapes,
    weighted by FLOPs as their times add (1 where nothing says otherwise: CPU ranks).

    Calibrated: each Linear's GEMM on one TP rank (:func:`_linear_gemms`) runs at the measured
    curve's rate for a square matmul of the same FLOPs (``n³ = m·k·n``, interpolated in ``log n``,
    clamped at the measured ends), over the rate at the largest size; each convolution's implicit
    GEMMs (:func:`~stratagem.advisor.cost.convolutions.conv_gemms`) likewise, or at the calibrated
    convolutions' rate for their arithmetic intensity where measured (:func:`_conv_rate`); and the
    attention core's written out, bounded by memory (:func:`_calibrated_attention`).
    Uncalibrated, on a GPU whose SMs the catalog counts: each Linear's and convolution's forward,
    input-gradient and weight-gradient GEMMs and the attention core's (:func:`_attention_gemms`:
    written out, unless fused attention is priced apart) at :func:`gemm_efficiency`, a
    convolution's streaming its tensors, not its window matrix."""
    if curve:
        convs = conv_curve(cluster, plan.precision) if cluster is not None else []
        # a Linear's forward, input-gradient and weight-gradient GEMMs share its size, as the
        # convolutions' and the attention's are weighed, each of their GEMMs
        linears = ((3 * count * size, 3 * count * size / log_interpolated(curve, size ** (1 / 3)) * curve[-1][1])
                   for count, rows, inner, outer in _linear_gemms(profile, plan, stage)
                   for size in [rows * inner * outer])
        return _weighted((*linears, *_calibrated_convs(profile, plan, stage, curve, convs),
                          *_calibrated_attention(profile, plan, stage, curve, cluster)))
    if cluster is None or not cluster.is_accelerator or not cluster.device.num_sms:
        return 1.0
    device = cluster.device
    shape = functools.partial(gemm_efficiency, sms=device.num_sms, flops_per_second=large_gemm_rate(cluster, plan.precision),
                              element_bytes=get_precision(plan.precision).compute_bytes,
                              bytes_per_second=device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY)
    linears = ((count * rows * inner * outer, shape(*dims))
               for count, rows, inner, outer in _linear_gemms(profile, plan, stage)
               for dims in ((rows, outer, inner), (rows, inner, outer), (inner, outer, rows)))
    # Weighted in multiply-adds (m·n·k), as the Linears and convolutions are: half the FLOPs.
    fused_apart = prices_fused_attention(cluster, matmul_dtype(cluster, plan.precision))
    attention = ((flops / 2, shape(*dims, batch=batch))
                 for flops, batch, dims in _attention_gemms(profile, plan, stage, fused_apart=fused_apart))
    convs = ((count * gemm.size, shape(gemm.m, gemm.n, gemm.k, batch=gemm.batch, moved=gemm.moved))
             for count, _, gemm in _block_conv_gemms(profile, plan, stage))
    return _weighted((flops, flops / efficiency) for flops, efficiency in (*linears, *attention, *convs))


def _block_conv_gemms(profile: ModelProfile, plan: Plan, stage: Stage) -> Iterator[tuple[int, ConvLayer, ConvGemm]]:
    """``(count, conv, gemm)`` of each implicit GEMM of the stage's blocks' convolutions for one
    micro-batch; TP leaves convolutions whole."""
    scale = plan.micro_batch_size / profile.batch_size
    for block, count in stage.kinds:
        for conv in block.convs:
            for gemm in conv_gemms(conv, scale):
                yield count, conv, gemm


def _calibrated_convs(profile: ModelProfile, plan: Plan, stage: Stage, curve: list[tuple[int, float]],
                      convs: list[tuple[float, float]]) -> Iterator[tuple[float, float]]:
    """``(work, work / efficiency)`` of the blocks' convolutions' GEMMs on a calibrated rank: at the
    convolutions' measured rate for their intensity (``convs``), else at the matmul ``curve``'s for
    a square GEMM of the same FLOPs per group, over the curve's largest rate."""
    scale = plan.micro_batch_size / profile.batch_size
    element_bytes = get_precision(plan.precision).compute_bytes
    for count, conv, gemm in _block_conv_gemms(profile, plan, stage):
        work = count * gemm.size
        if convs:
            rate = _conv_rate(convs, arithmetic_intensity(conv, scale, element_bytes))
        else:
            rate = log_interpolated(curve, (gemm.m * gemm.n * gemm.k) ** (1 / 3))
        yield work, work / rate * curve[-1][1]


def _calibrated_attention(profile: ModelProfile, plan: Plan, stage: Stage, curve: list[tuple[int, float]],
                          cluster: Cluster | None) -> Iterator[tuple[float, float]]:
    """``(work, work / efficiency)`` of the blocks' written-out attention GEMMs
    (:func:`_attention_gemms`) on a calibrated rank: at the matmul ``curve``'s rate for a square
    GEMM of all the batch's multiply-adds, and no faster than they stream their operands and
    output at the device's bandwidth (roofline, Williams et al. 2009), as the uncalibrated
    :func:`gemm_efficiency` bounds them: the ``s × s`` scores of a head a few dozen wide move more
    bytes than their FLOPs take (BLOOM's eager attention). Nothing without a cluster."""
    if cluster is None:
        return
    element_bytes = get_precision(plan.precision).compute_bytes
    bandwidth = cluster.device.memory_bandwidth * MEMORY_BANDWIDTH_EFFICIENCY
    # fused kernels never write their scores out: priced apart, or at the GEMMs' calibrated rate
    # by a calibration taken before attention was measured (prices_fused_attention)
    for flops, batch, (m, n, k) in _attention_gemms(profile, plan, stage, fused_apart=True):
        each = batch * m * n * k  # one call's multiply-adds; ``flops`` sums the blocks' and passes'
        compute = 2 * each / log_interpolated(curve, each ** (1 / 3))
        memory = _streamed_seconds(m, n, k, batch=batch, element_bytes=element_bytes, bytes_per_second=bandwidth)
        yield flops / 2, flops / 2 * max(compute, memory) / (2 * each / curve[-1][1])


def _conv_rate(curve: list[tuple[float, float]], intensity: float) -> float:
    """The calibrated convolutions' FLOP/s at ``intensity`` FLOPs per byte (``curve`` sorted by
    it): linear in ``log intensity`` between measured points, the most intense one's rate above
    them, and below the least intense in proportion to intensity, as memory binds there (roofline,
    Williams et al. 2009)."""
    if intensity <= curve[0][0]:
        return curve[0][1] * intensity / curve[0][0]
    return log_interpolated(curve, intensity)


def _weighted(pairs: Iterable[tuple[float, float]]) -> float:
    """FLOPs over time, from ``(flops, flops / efficiency)`` pairs; 1 without any."""
    flops = seconds = 0.0
    for work, time in pairs:
        flops += work
        seconds += time
    return flops / seconds if seconds else 1.0


def _linear_gemms(profile: ModelProfile, plan: Plan, stage: Stage) -> Iterator[tuple[int, float, float, float]]:
    """``(count, rows, inner, outer)`` of each Linear of the stage's blocks as one TP rank
    multiplies it per micro-batch: the split side divided by TP; rows those the profile saw
    (:func:`linear_rows`), else the block's tokens, from its FLOPs with the attention core set aside."""
    styles = plan.block_tp_styles if plan.tp > 1 else {}
    scale = plan.micro_batch_size / profile.batch_size
    for block, count in stage.kinds:
        widths = sum(linear.in_features * linear.out_features for linear in block.linears)
        if not widths:
            continue
        convs = sum(forward_flops(conv) for conv in block.convs)  # 0 without any
        per_sample = (block.fwd_flops - block.attention_fwd_flops - convs) / (2 * widths) / profile.batch_size
        for linear in block.linears:
            style = styles.get(linear.name)
            inner = linear.in_features / (plan.tp if style == "rowwise" else 1)
            outer = linear.out_features / (plan.tp if style == "colwise" else 1)
            yield count, linear_rows(linear, scale, per_sample * plan.micro_batch_size), inner, outer


def _attention_gemms(profile: ModelProfile, plan: Plan, stage: Stage, *,
                     fused_apart: bool) -> Iterator[tuple[float, float, tuple]]:
    """``(flops, batch, (m, n, k))`` of the attention core's GEMMs per micro-batch on one TP
    rank: scores ``s×d·d×s`` and their product with the values ``s×s·s×d`` for each sample and
    head, the backward's four as two of each; the head width ``d`` the block's model width over
    its heads; with ``fused_apart``, those of explicit attention alone (fused kernels are priced
    by :mod:`~stratagem.advisor.cost.attention`). Nothing for a model without heads or sequence."""
    if not profile.num_heads or not profile.seq_len:
        return
    s, heads = profile.seq_len, profile.num_heads / plan.tp
    scale = plan.micro_batch_size / profile.batch_size
    for block, count in stage.kinds:
        explicit = block.attention_fwd_flops - (sum(c.fwd_flops for c in block.fused_attention) if fused_apart else 0)
        if not explicit or not block.linears:
            continue
        width = model_width(block) / profile.num_heads
        flops = count * explicit * scale / plan.tp * 3  # forward, and backward at twice it
        batch = plan.micro_batch_size * heads
        yield flops / 2, batch, (s, s, width)
        yield flops / 2, batch, (s, width, s)


def linear_rows(linear: LinearLayer, batch_scale: float, tokens: float) -> float:
    """Rows ``linear`` multiplies per micro-batch: the profiled rows scaled by ``batch_scale``
    (micro-batch over profiled batch), or ``tokens`` where the profile recorded none."""
    return linear.rows * batch_scale if linear.rows else tokens


def kernel_gap_seconds(cluster: Cluster) -> float:
    """Device seconds each kernel launched adds between itself and the next: on GPUs
    :data:`KERNEL_GAP_SECONDS` (not calibrated), elsewhere none."""
    return KERNEL_GAP_SECONDS if cluster.device.is_gpu else 0.0


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


@functools.lru_cache(maxsize=1 << 16)  # the search's plans repeat a few shapes thousands of times
def gemm_efficiency(m: float, n: float, k: float, *, sms: int, element_bytes: int,
                    flops_per_second: float, bytes_per_second: float, batch: float = 1,
                    moved: float | None = None) -> float:
    """The share of ``flops_per_second`` (what the largest GEMMs reach) ``batch`` ``m×k · k×n``
    GEMMs reach on a GPU of ``sms`` streaming multiprocessors: their outputs padded to whole tiles
    (:data:`GEMM_TILES`, the best of them), the tiles run one per SM in waves, too few of them
    split along ``k`` (:data:`SPLIT_K_MIN`); and no faster than each streams ``moved`` elements
    from memory at ``bytes_per_second`` (roofline, Williams et al. 2009): its operands and output,
    ``m·k + k·n + m·n``, unless given (an implicit GEMM's are fewer)."""
    if min(m, n, k, batch) <= 0:
        return 1.0
    ideal = 2 * batch * m * n * k / flops_per_second
    per_sm = flops_per_second / sms
    compute = min(_tiled_seconds(m, n, k, tile, batch=batch, sms=sms, per_sm=per_sm) for tile in GEMM_TILES)
    memory = _streamed_seconds(m, n, k, batch=batch, element_bytes=element_bytes, bytes_per_second=bytes_per_second,
                               moved=moved)
    return ideal / max(compute, memory)


def _streamed_seconds(m: float, n: float, k: float, *, batch: float, element_bytes: int, bytes_per_second: float,
                      moved: float | None = None) -> float:
    """Seconds ``batch`` ``m×k · k×n`` GEMMs take to stream ``moved`` elements each (their operands
    and output, ``m·k + k·n + m·n``, unless given) at ``bytes_per_second``: the roofline's memory side."""
    return batch * (m * k + k * n + m * n if moved is None else moved) * element_bytes / bytes_per_second


def _tiled_seconds(m: float, n: float, k: float, tile: tuple[int, int], *, batch: float, sms: int,
                   per_sm: float) -> float:
    """Seconds of GEMMs computed in ``tile``-sized output blocks, one per SM at a time, with the
    split along ``k`` (into slices of at least :data:`SPLIT_K_MIN`) that fills the waves best."""
    tiles = math.ceil(batch) * math.ceil(m / tile[0]) * math.ceil(n / tile[1])
    most = max(1, min(math.ceil(sms / tiles) * 2, int(k // SPLIT_K_MIN))) if tiles < sms else 1
    waves = min(math.ceil(tiles * s / sms) / s for s in range(1, most + 1))  # in units of the whole k
    return waves * 2 * tile[0] * tile[1] * k / per_sm


def model_width(block: SegmentProfile) -> int:
    """``h``, the width of the residual stream a block reads: its first Linear's input width (0
    for a block without Linears)."""
    return block.linears[0].in_features if block.linears else 0
