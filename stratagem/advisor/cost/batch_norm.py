"""BatchNorm on batch statistics as an NVIDIA GPU runs it in 16 bits: ATen's kernels, which read
the input more often than the operator's bytes say and, in NCHW with few channels, stream it
slower than the memory can (docs/cost-model.md, "BatchNorm's kernels").

PyTorch hands a BatchNorm to cuDNN unless its input or weight is bfloat16, it is float16 with a
float16 weight, or it has no affine weight (``_select_batch_norm_backend``,
aten/src/ATen/native/Normalization.cpp): under bf16 autocast a convolution's bf16 output with
BatchNorm's fp32 weight runs on ATen's own CUDA kernels (aten/src/ATen/native/cuda/Normalization.cu
and .cuh), in either layout:

- forward: a statistics kernel reads the input once, then an elementwise kernel reads it again
  and writes the output. The operator's bytes count the second pass only.
- backward: the input and the output's gradient are reduced, then read again to write the
  input's gradient (one kernel in NCHW, two channels-last): five passes where the operator's
  bytes count three.

In NCHW the statistics and backward kernels launch one block of :data:`THREADS_PER_BLOCK` threads
per channel (``dim3 blocks(input.size(1))``), and each thread loads one element at a time: a
resident block streams ``THREADS_PER_BLOCK · element bytes / memory latency`` bytes per second
(Little's law). With one block per channel, as many as fit on the SMs at once, a read of ``B``
bytes takes ``B / bandwidth + B · latency / (blocks · threads · element bytes)``: its bytes at
the memory's rate plus the latency that too few loads in flight leave unhidden. The channels-last
kernels spread each channel over many blocks; their passes are priced at the memory's rate.
"""

from __future__ import annotations

from stratagem.advisor.cost.stages import Stage
from stratagem.advisor.hardware.spec import Cluster, DeviceSpec
from stratagem.advisor.memo import by_identity
from stratagem.advisor.profile.model_profile import BatchNormCall, ModelProfile, SegmentProfile
from stratagem.plan import Plan
from stratagem.plan.precision import DTYPE_BYTES

THREADS_PER_BLOCK = 512
"""Threads of each block ATen's per-channel BatchNorm kernels launch on CUDA (``MAX_BLOCK_SIZE``
in aten/src/ATen/native/cuda/Normalization.cuh; 256 on ROCm, which these costs leave out)."""

_RESIDENT_THREADS = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}
"""Most threads resident on one SM by compute capability where not 2,048 (CUDA C++ Programming
Guide, "Technical Specifications per Compute Capability")."""

BACKWARD_OPERATOR_PASSES = 3
"""Passes over input-sized tensors a BatchNorm's backward operator counts (the input and the
output's gradient read, the input's gradient written): what :func:`aten_seconds` adds to."""


def _on_nvidia_gpu(cluster: Cluster) -> bool:
    return cluster.device.is_gpu and cluster.device.vendor == "nvidia"


def _input_bytes(call: BatchNormCall) -> tuple[int, int]:
    """``call``'s input's bytes and its elements' (the 16- and 32-bit types, else float64)."""
    element_bytes = DTYPE_BYTES.get(call.dtype, 8)
    return call.elements * element_bytes, element_bytes


def runs_aten_kernels(call: BatchNormCall, cluster: Cluster) -> bool:
    """Whether ``call`` runs on ATen's kernels on ``cluster``: an NVIDIA GPU and a BatchNorm cuDNN
    is not given (module docstring)."""
    return _on_nvidia_gpu(cluster) and (call.weight_dtype is None or "bfloat16" in (call.dtype, call.weight_dtype)
                                        or (call.dtype == "float16" and call.weight_dtype != "float32"))


def aten_seconds(call: BatchNormCall, device: DeviceSpec, seconds_per_byte: float) -> tuple[float, float]:
    """Seconds ATen's kernels take for ``call`` beyond what its operators' bytes cost at
    ``seconds_per_byte``, at the profiled batch, ``(forward, backward)``: the statistics' read of
    the input, the backward's reduction reading the input and the output's gradient, and in NCHW
    the latency every read by one block per channel leaves unhidden (module docstring), where the
    device's is known (``DeviceSpec.memory_latency``, the SMs catalogued)."""
    size, element_bytes = _input_bytes(call)
    forward, backward = size * seconds_per_byte, 2 * size * seconds_per_byte
    if not call.channels_last and device.memory_latency is not None and device.num_sms:
        per_sm = _RESIDENT_THREADS.get(tuple(device.compute_capability or ()), 2048) // THREADS_PER_BLOCK
        in_flight = min(call.channels, device.num_sms * per_sm) * THREADS_PER_BLOCK * element_bytes
        latency = size * device.memory_latency / in_flight  # one pass over the input, one load per thread
        forward += latency
        backward += 2 * latency  # four passes, two loads (input, gradient) in flight per thread
    return forward, backward


def nchw_kernel_seconds(call: BatchNormCall, device: DeviceSpec, seconds_per_byte: float) -> tuple[float, float]:
    """The whole of ATen's NCHW statistics kernel and backward kernel for ``call``, as a profiler
    times them: :func:`aten_seconds`, and the backward's passes its operator counts."""
    statistics, backward = aten_seconds(call, device, seconds_per_byte)
    return statistics, backward + BACKWARD_OPERATOR_PASSES * _input_bytes(call)[0] * seconds_per_byte


def stage_norm_seconds(stage: Stage, plan: Plan, cluster: Cluster,
                       seconds_per_byte: float) -> dict[tuple[str, bool], float]:
    """Seconds :func:`aten_seconds` adds to one micro-batch of the profiled batch on one TP rank,
    keyed ``(direction, blocks only)``: the blocks' divided over TP as their other work is, none
    where the plan compiles them (inductor writes its own kernels), the embedding's and head's
    whole."""
    if not _on_nvidia_gpu(cluster):
        return _NONE
    return _stage_norm_seconds(stage, plan.compile, plan.tp, cluster, seconds_per_byte)


_NONE = {(direction, blocks_only): 0.0 for direction in ("fwd", "bwd") for blocks_only in (False, True)}


@by_identity
def _stage_norm_seconds(stage: Stage, compiled: bool, tp: int, cluster: Cluster,
                        seconds_per_byte: float) -> dict[tuple[str, bool], float]:
    """:func:`stage_norm_seconds`, once per stage and what it reads of the plan."""
    def seconds(segment: SegmentProfile) -> tuple[float, float]:
        calls = [aten_seconds(call, cluster.device, seconds_per_byte)
                 for call in segment.batch_norms if runs_aten_kernels(call, cluster)]
        return sum(f for f, _ in calls), sum(b for _, b in calls)

    blocks, outside = [0.0, 0.0], [0.0, 0.0]
    if not compiled:
        for block, count in stage.kinds:
            for i, value in enumerate(seconds(block)):
                blocks[i] += count * value / tp
    in_blocks = {id(block) for block in stage.blocks}
    for segment in stage.segments:
        if id(segment) not in in_blocks:
            for i, value in enumerate(seconds(segment)):
                outside[i] += value
    return {("fwd", True): blocks[0], ("bwd", True): blocks[1],
            ("fwd", False): blocks[0] + outside[0], ("bwd", False): blocks[1] + outside[1]}


def latency_unknown_note(profile: ModelProfile, cluster: Cluster) -> tuple[str, ...]:
    """A note where ``profile``'s BatchNorms run on ATen's per-channel (NCHW) kernels on ``cluster``
    and the device's memory latency, which bounds them, is not known."""
    device = cluster.device
    if device.memory_latency is not None and device.num_sms:
        return ()
    calls = [call for segment in profile.segments for call in segment.batch_norms
             if runs_aten_kernels(call, cluster) and not call.channels_last]
    if not calls:
        return ()
    return (f"{len(calls)} BatchNorm layers run on ATen's per-channel kernels ({calls[0].dtype}, NCHW), which stream "
            f"slower than memory allows with few channels; {device.name}'s memory latency is not catalogued, so "
            "they are priced by their passes over memory alone (too fast). `stratagem calibrate` measures it; a "
            "model moved to torch.channels_last runs other kernels.",)
