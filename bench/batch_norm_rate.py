"""BatchNorm's training step on a GPU by shape, dtype and memory format: the time of the forward
and of forward plus backward, the rate at which they stream the input (forward: read twice,
written once; backward: the input and its gradient read twice, the input's gradient written),
and the kernels that ran. Under bf16 autocast a convolution's output reaches BatchNorm in 16
bits with fp32 weights, which cuDNN's NCHW kernels do not take: ATen's own kernels run it.
Where they do, each line ends with the cost model's time for ATen's statistics kernel and its
backward kernel beside the profiler's (``stratagem.advisor.cost.batch_norm``, on this GPU as
the catalog and a stored calibration describe it: docs/cost-model.md, "BatchNorm's kernels").

    python bench/batch_norm_rate.py          # ResNet-50's shapes at 256 images

On CPU it runs too, at 8 images, for checking the script.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from timing import median_seconds, sync

from stratagem.advisor.calibrate import calibrated
from stratagem.advisor.cost.batch_norm import nchw_kernel_seconds, runs_aten_kernels
from stratagem.advisor.cost.rates import seconds_per_op_byte
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.hardware.probe import probe_local
from stratagem.advisor.profile.batch_norms import batch_norm_call

SHAPES = ((64, 112, 112), (256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7))  # ResNet-50's
PASSES = 8  # input-sized tensors streamed by forward (3) and backward (5)


def run_case(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, device: torch.device,
             cluster: Cluster) -> None:
    x = torch.randn(shape, device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    channels = shape[1]
    weight = torch.ones(channels, device=device, requires_grad=True)
    bias = torch.zeros(channels, device=device, requires_grad=True)
    mean, var = torch.zeros(channels, device=device), torch.ones(channels, device=device)
    grad = torch.randn_like(x)

    def forward() -> torch.Tensor:
        return F.batch_norm(x, mean, var, weight, bias, training=True)

    def both() -> None:  # autograd.grad, not backward: nothing accumulates into .grad between calls
        torch.autograd.grad(forward(), (x, weight, bias), grad)

    forward_s, both_s = median_seconds(forward), median_seconds(both)
    activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else \
        [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        both()
        sync()
    timed = sorted(((event.self_device_time_total or event.self_cpu_time_total, event.key)
                    for event in profile.key_averages()), reverse=True)
    size = x.numel() * x.element_size()
    print(f"{tuple(shape)} {str(dtype)[6:]} {'channels-last' if channels_last else 'NCHW'}: forward "
          f"{forward_s * 1e3:.2f} ms, forward+backward {both_s * 1e3:.2f} ms "
          f"({PASSES * size / both_s / 1e9:.0f} GB/s); "
          + "; ".join(f"{key[:60]} {micros / 1e3:.2f} ms" for micros, key in timed[:2])
          + _against_the_model(x, weight, timed, cluster), flush=True)


def _against_the_model(x: torch.Tensor, weight: torch.Tensor, timed: list[tuple[float, str]], cluster: Cluster) -> str:
    """ATen's NCHW statistics and backward kernels as the profiler timed them, beside the cost
    model's times for them; empty where other kernels run the case."""
    call = batch_norm_call(torch.ops.aten.native_batch_norm, (x, weight, None, None, None, True, 0.1, 1e-5), {})
    if call.channels_last or not runs_aten_kernels(call, cluster):
        return ""
    statistics, backward = nchw_kernel_seconds(call, cluster.device, seconds_per_op_byte(cluster))
    measured = {kind: sum(micros for micros, key in timed if name in key) / 1e3
                for kind, name in (("statistics", "collect_statistics"), ("backward", "batch_norm_backward_kernel"))}
    return (f" | model: statistics {statistics * 1e3:.2f} ms (measured {measured['statistics']:.2f}), "
            f"backward {backward * 1e3:.2f} ms (measured {measured['backward']:.2f})")


def main() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    images = 256 if device.type == "cuda" else 8
    cluster = calibrated(probe_local())
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for channels_last in (False, True):
                run_case((images, *shape), dtype, channels_last, device, cluster)


if __name__ == "__main__":
    main()
