"""The attention core's fused kernels (SDPA on flash, memory-efficient or cuDNN attention): their
seconds per micro-batch on a GPU, apart from the GEMMs' rates (docs/cost-model.md, "Attention").

A fused kernel never writes the ``s × s`` scores: it computes them a tile at a time, with the
softmax between its two products, so it runs neither at a GEMM's rate nor at the memory's. Where
``stratagem calibrate`` timed SDPA on the GPU (``NodeSpec.attention_curve``), a call runs at the
measured rate for its head width and causality, interpolated by sequence length over the work its
tiles do. Uncalibrated, the tile model prices it (:func:`tile_seconds`): the scores padded to
whole tiles, causal calls computing only the tiles on and below the diagonal, their products at the
share of the peak the published kernels reach, plus the passes over the rows the kernels make
outside their loop over the tiles, at the memory's rate. CPU ranks keep attention among their
matmuls, measured there at their rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stratagem.advisor.cost.curves import log_interpolated
from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.hardware.spec import Cluster
from stratagem.advisor.profile.model_profile import AttentionCall, ModelProfile
from stratagem.plan import Plan

# Query and key rows a fused kernel computes its scores in, per tile: FlashAttention-2's kernels tile
# them 128 × 128 at head widths up to 128 (Dao 2023, "FlashAttention-2", §3.3 and its sm80 kernel
# traits); a sequence runs padded to whole tiles.
ATTENTION_TILE = 128

# Tensor-core FLOPs per score element and unit of head width: forward QKᵀ and PV, 2 × 2d; backward
# the scores again, dP, dV, dQ and dK, 5 × 2d (FlashAttention-2, Algorithms 1 and 2).
TENSOR_FLOPS = {"fwd": 4, "bwd": 10}

# Share of the dense 16-bit peak the kernel torch picks reaches on the work its tiles do, softmax
# included, by compute capability, direction and head width (linear between the widths listed, the
# ends' beyond them). A100: FlashAttention-2, 50-73 % (Dao 2023, abstract; the lower end taken: head
# width 64 and causal masks sit there). H100 and H200: cuDNN's kernels, which torch prefers on them
# (`check_prefer_cudnn_attention` in sdp_utils.cpp; the kernels the H100 runs traced), at the rates
# Shah et al. 2024 publish for them ("FlashAttention-3", Figs. 5 and 6: 16k tokens, not causal, 413
# and 595 TFLOP/s forward at widths 64 and 128, 433 and 516 backward) less the time of their rows'
# passes (ATTENTION_ROW_PASSES). `stratagem calibrate` measures the kernel torch picks instead.
ATTENTION_PEAK_SHARE = {
    (8, 0): {"fwd": ((64, 0.5),), "bwd": ((64, 0.5),)},
    (9, 0): {"fwd": ((64, 0.42), (128, 0.61)), "bwd": ((64, 0.45), (128, 0.54))},
}

# Passes over one head's rows, in elements of the head width at 16 bits, that a fused kernel makes
# outside its loop over the tiles, per query row and per key row: they stream at the memory's rate
# instead of hiding under the tiles' products. Forward: each query tile's block loads its queries
# before the loop and stores its output after it (2, 0). Backward: a kernel before the main one reads
# the output and its gradient for their row-wise dot product and clears the query gradient's fp32
# accumulator (2 + 2), one after it converts that accumulator to 16 bits (2 + 1), and each key
# tile's block loads its keys and values and stores their gradients (4 per key row) (FlashAttention-2,
# Algorithm 2, and its kernels; cuDNN's backward runs the same passes). Key rows count per key and
# value head: grouped-query attention's query heads share them. With them cuDNN's published H100
# rates hold from 512 tokens to 16k (docs/cost-model.md, "Attention").
ATTENTION_ROW_PASSES = {"fwd": (2, 0), "bwd": (7, 4)}

# The matmul dtypes fused kernels are priced and calibrated in (flash attention takes 16 bits only),
# and the bytes of an element of theirs.
ATTENTION_DTYPES = ("bf16", "fp16")
ELEMENT_BYTES = 2

DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True, slots=True)
class AttentionTime:
    """The fused attention calls of the rank's stage (or of its blocks only) per micro-batch on one
    TP rank, per direction: their FLOPs as counted (which the GEMMs' rate no longer prices) and
    their seconds."""

    flops: dict[str, float]
    seconds: dict[str, float]


def fused_attention_time(profile: ModelProfile, plan: Plan, stage: Stage, cluster: Cluster, *,
                         dtype: str, seconds_per_byte: float) -> dict[bool, AttentionTime] | None:
    """:class:`AttentionTime` of the stage's blocks (key ``True``) and of the whole stage
    (``False``) in ``dtype``'s matmuls: at the calibrated curve's rates where measured, else by the
    tile model (:func:`tile_seconds`, its rows' passes at ``seconds_per_byte``); None where
    :func:`prices_fused_attention` says neither applies, so attention stays among the GEMMs."""
    if not prices_fused_attention(cluster, dtype):
        return None
    curve = attention_curve(cluster, dtype)
    batch_scale = plan.micro_batch_size / profile.batch_size
    blocks = [(call, count / plan.tp) for block, count in stage.kinds for call in block.fused_attention]  # TP splits heads
    block_names = {block.name for block in stage.blocks}
    outside = [(call, 1) for segment in stage.segments if segment.name not in block_names
               for call in segment.fused_attention]

    def time(calls: list[tuple[AttentionCall, float]]) -> AttentionTime:
        flops = {d: 0.0 for d in DIRECTIONS}
        seconds = {d: 0.0 for d in DIRECTIONS}
        for call, share in calls:
            for direction in DIRECTIONS:
                flops[direction] += share * batch_scale * (call.fwd_flops if direction == "fwd" else call.bwd_flops)
                seconds[direction] += share * batch_scale * (
                    curve_seconds(call, direction, curve) if curve else
                    tile_seconds(call, direction, cluster, dtype=dtype, seconds_per_byte=seconds_per_byte))
        return AttentionTime(flops=flops, seconds=seconds)

    return {True: time(blocks), False: time(blocks + outside)}


def attention_curve(cluster: Cluster, dtype: str) -> list[tuple[int, bool, int, float, float]]:
    """The calibrated (head width, causal, sequence, forward FLOP/s, backward FLOP/s) of fused
    attention in ``dtype`` (``NodeSpec.attention_curve``), sorted; empty where not measured."""
    return sorted(point[1:] for point in cluster.node.attention_curve if point[0] == dtype)


def prices_fused_attention(cluster: Cluster, dtype: str) -> bool:
    """Whether fused attention in ``dtype`` is priced apart from the GEMMs on ``cluster``: where
    calibrated with its curve; uncalibrated, on GPUs of a compute capability
    :data:`ATTENTION_PEAK_SHARE` lists, in 16 bits. A calibration taken before attention was
    measured keeps it among the GEMMs, at their calibrated rate."""
    if not cluster.is_accelerator:
        return False
    if cluster.node.matmul_curve:
        return bool(attention_curve(cluster, dtype))
    return dtype in ATTENTION_DTYPES and cluster.device.compute_capability in ATTENTION_PEAK_SHARE


def tile_seconds(call: AttentionCall, direction: str, cluster: Cluster, *, dtype: str,
                 seconds_per_byte: float) -> float:
    """Seconds of ``call`` (at the profiled batch) in ``direction`` on ``cluster``'s GPU by the tile
    model: the score elements its tiles compute (:func:`computed_elements`), :data:`TENSOR_FLOPS` ×
    the head width each, at :func:`peak_share` of the dense ``dtype`` peak, and its rows' passes
    (:func:`row_pass_seconds`)."""
    rate = peak_share(cluster.device.compute_capability, direction, call.head_dim) * cluster.device.peak_flops(dtype)
    return (computed_elements(call) * TENSOR_FLOPS[direction] * call.head_dim / rate
            + row_pass_seconds(call, direction, seconds_per_byte))


def row_pass_seconds(call: AttentionCall, direction: str, seconds_per_byte: float) -> float:
    """Seconds of the passes over ``call``'s rows in ``direction`` outside the tiles' loop
    (:data:`ATTENTION_ROW_PASSES`, the key rows once per key and value head) at ``seconds_per_byte``."""
    per_query, per_key = ATTENTION_ROW_PASSES[direction]
    rows = _heads(call) * (per_query * call.seq_q + per_key * call.seq_kv / call.kv_group)
    return rows * call.head_dim * ELEMENT_BYTES * seconds_per_byte


def peak_share(compute_capability: tuple[int, int], direction: str, head_dim: int) -> float:
    """:data:`ATTENTION_PEAK_SHARE` of a GPU of ``compute_capability`` in ``direction`` at head width
    ``head_dim``: linear between the widths listed, the nearest end's beyond them."""
    points = ATTENTION_PEAK_SHARE[compute_capability][direction]
    (low, low_share), (high, high_share) = points[0], points[-1]
    if head_dim <= low or low == high:
        return low_share
    if head_dim >= high:
        return high_share
    return low_share + (high_share - low_share) * (head_dim - low) / (high - low)


def computed_elements(call: AttentionCall) -> float:
    """Score elements ``call``'s tiles compute at the profiled batch: every sequence padded to whole
    :data:`ATTENTION_TILE` tiles; a causal call only the tiles on and below the diagonal."""
    return _heads(call) * _tiles(call.seq_q, call.seq_kv, call.causal) * ATTENTION_TILE ** 2


def _heads(call: AttentionCall) -> float:
    """Batch × heads of ``call`` at the profiled batch, from torch's count of its forward FLOPs."""
    return call.fwd_flops / (4 * call.seq_q * call.seq_kv * call.head_dim)


def curve_seconds(call: AttentionCall, direction: str, curve: list[tuple[int, bool, int, float, float]]) -> float:
    """Seconds of ``call`` in ``direction`` at the calibrated rates (``curve``: sorted (head width,
    causal, sequence, forward FLOP/s, backward FLOP/s)): those of the measured head width nearest
    its own (in ratio; its cost in proportion to the width) and its causality, as seconds per score
    element the tiles compute (so that padding and the diagonal scale as the tiles do) interpolated
    in ``log`` of the key length each tile loops over, padded to whole tiles as the kernel runs it
    (197 keys at 256's cost, not between 128's and 256's), the measured ends' beyond them."""
    width = min({point[0] for point in curve}, key=lambda w: abs(math.log(w / call.head_dim)))
    points = [p for p in curve if p[0] == width and p[1] == call.causal] or [p for p in curve if p[0] == width]
    column, counted = (3, 1.0) if direction == "fwd" else (4, call.bwd_flops / call.fwd_flops)  # the counter's ratio
    per_element = sorted((seq, counted * _counted_per_element(seq, width, causal) / point[column])
                         for point in points for _, causal, seq in (point[:3],))
    padded = math.ceil(call.seq_kv / ATTENTION_TILE) * ATTENTION_TILE
    return computed_elements(call) * log_interpolated(per_element, padded) * call.head_dim / width


def _counted_per_element(seq: int, width: int, causal: bool) -> float:
    """Forward FLOPs torch's counter counts per score element the tiles compute, for one head of
    ``seq`` query and key rows."""
    return 4 * seq * seq * width / (_tiles(seq, seq, causal) * ATTENTION_TILE ** 2)


def _tiles(seq_q: int, seq_kv: int, causal: bool) -> int:
    """Tiles of one head's scores a kernel computes: all of them, or for a causal call those on
    and below the diagonal (query tile ``i`` reaches key tiles ``0 … i``)."""
    rows, columns = math.ceil(seq_q / ATTENTION_TILE), math.ceil(seq_kv / ATTENTION_TILE)
    if not causal:
        return rows * columns
    square = min(rows, columns)
    return square * (square + 1) // 2 + max(0, rows - columns) * columns
