"""BatchNorm's training step on a GPU by shape, dtype and memory format: the time of the forward
and of forward plus backward, the rate at which they stream the input (forward: read twice,
written once; backward: the input and its gradient read twice, the input's gradient written),
and the kernels that ran. Under bf16 autocast a convolution's output reaches BatchNorm in 16
bits with fp32 weights, which cuDNN's NCHW kernels do not take: ATen's own kernels run it.

    python bench/batch_norm_rate.py          # ResNet-50's shapes at 256 images

On CPU it runs too, at 8 images, for checking the script.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from timing import median_seconds, sync

SHAPES = ((64, 112, 112), (256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7))  # ResNet-50's
PASSES = 8  # input-sized tensors streamed by forward (3) and backward (5)


def run_case(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, device: torch.device) -> None:
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
    kernels = sorted(((event.self_device_time_total or event.self_cpu_time_total, event.key)
                      for event in profile.key_averages()), reverse=True)[:2]
    size = x.numel() * x.element_size()
    print(f"{tuple(shape)} {str(dtype)[6:]} {'channels-last' if channels_last else 'NCHW'}: forward "
          f"{forward_s * 1e3:.2f} ms, forward+backward {both_s * 1e3:.2f} ms "
          f"({PASSES * size / both_s / 1e9:.0f} GB/s); "
          + "; ".join(f"{key[:60]} {micros / 1e3:.2f} ms" for micros, key in kernels), flush=True)


def main() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    images = 256 if device.type == "cuda" else 8
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for channels_last in (False, True):
                run_case((images, *shape), dtype, channels_last, device)


if __name__ == "__main__":
    main()
