"""The attention core's rate on a GPU by sequence length, head width and causality, as `stratagem
calibrate` measures it (`stratagem.advisor.calibrate.attention`): SDPA's forward and backward apart
on the kernel torch picks, in TFLOP/s as torch's counter counts them (the whole ``s × s``, causal or
not), beside a large GEMM's, and what the uncalibrated tile model (`stratagem.advisor.cost.attention`)
predicts for the same call on this device.

On one H100, cuDNN's kernels took 9.4 ms a step for GPT-2 large's attention core and 5.3 ms for
ViT-L/16's (docs/benchmarks.md, "GPU figures"); ``bench/gpu_predictions.py`` prints what the tile
model gives for both.

    python bench/attention_rate.py            # on a GPU; on CPU at small sizes, to check the script
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from timing import median_seconds
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from stratagem.advisor.calibrate.attention import attention_rates
from stratagem.advisor.cost.attention import ATTENTION_PEAK_SHARE, tile_seconds
from stratagem.advisor.cost.rates import seconds_per_op_byte
from stratagem.advisor.hardware import probe_local
from stratagem.advisor.profile.model_profile import AttentionCall


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype, torch_dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    with socket.socket() as sock:  # the benchmark agrees on its timings over a process group
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    side = 8192 if cuda else 512
    a = torch.randn(side, side, device=device, dtype=torch_dtype)
    gemm = 2 * side**3 / median_seconds(lambda: a @ a)
    print(f"GEMM {side}³ {dtype}: {gemm / 1e12:.3g} TFLOP/s", flush=True)
    cluster = probe_local()
    modelled = cuda and cluster.device.compute_capability in ATTENTION_PEAK_SHARE
    sizes = {} if cuda else dict(sequences=(64, 256), widths=(16,), tokens=1024)
    rates = attention_rates([dtype], device, repeats=3, **sizes)
    dist.destroy_process_group()
    model = "   tile model (uncalibrated): forward, backward" if modelled else ""
    print(f"{'s':>5} {'d':>4} {'':6}  forward  backward TFLOP/s as counted (of the GEMM's){model}")
    for width, causal, seq, fwd, bwd in rates[dtype]:
        line = (f"{seq:>5} {width:>4} {'causal' if causal else 'full':6} {fwd / 1e12:8.1f} {bwd / 1e12:9.1f}"
                f"  ({fwd / gemm:.0%}, {bwd / gemm:.0%})")
        if modelled:
            shape = (1, 1, seq, width)  # one head: the tile model's rate as torch's counter counts it
            call = AttentionCall(seq_q=seq, seq_kv=seq, head_dim=width, causal=causal,
                                 fwd_flops=sdpa_flop_count(shape, shape, shape),
                                 bwd_flops=sdpa_backward_flop_count(shape, shape, shape, shape))
            modelled_seconds = {direction: tile_seconds(call, direction, cluster, dtype=dtype,
                                                        seconds_per_byte=seconds_per_op_byte(cluster))
                                for direction in ("fwd", "bwd")}
            line += (f"   {call.fwd_flops / modelled_seconds['fwd'] / 1e12:8.1f}"
                     f" {call.bwd_flops / modelled_seconds['bwd'] / 1e12:9.1f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
