"""The attention core's rate on a GPU by sequence length, head width and causality: SDPA forward
and forward plus backward in bf16 on the kernel torch picks, in TFLOP/s as the profile counts its
FLOPs (the whole ``s × s``, causal or not: torch's FLOP counter), beside a large bf16 GEMM's.

The cost model prices the attention core at the GEMMs' rate; on one H100 cuDNN's flash kernel ran
GPT-2 large's (1,024 causal tokens, head width 64) at 490 TFLOP/s as counted and ViT-L/16's (197
tokens) at 138, against 676 for the GEMMs (docs/benchmarks.md, "GPU figures"). This measures the
curve a model of it needs.

    python bench/attention_rate.py            # on a GPU; on CPU at small sizes, to check the script
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import median_seconds

SEQUENCES = (197, 256, 1024, 4096)
HEAD_WIDTHS = (64, 128)
TOKENS = 65536  # per call: batch × sequence, heads of 1,024 model width in all


def counted_flops(batch: int, heads: int, seq: int, width: int) -> int:
    """The forward's FLOPs as torch's counter counts them: QKᵀ and the product with V, whole."""
    return 4 * batch * heads * seq * seq * width


def main() -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = TOKENS if device.type == "cuda" else 2048
    a = torch.randn(8192 if device.type == "cuda" else 512, 8192 if device.type == "cuda" else 512,
                    device=device, dtype=dtype)
    gemm = 2 * a.shape[0] ** 3 / median_seconds(lambda: a @ a) / 1e12
    print(f"GEMM {a.shape[0]}³ {str(dtype)[6:]}: {gemm:.3g} TFLOP/s", flush=True)
    for width in HEAD_WIDTHS:
        heads = 1024 // width
        for seq in SEQUENCES:
            batch = max(1, tokens // seq)
            q, k, v = (torch.randn(batch, heads, seq, width, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn_like(q)
            flops = counted_flops(batch, heads, seq, width)
            for causal in (False, True):
                def forward() -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def both() -> None:
                    torch.autograd.grad(forward(), (q, k, v), grad)

                fwd = flops / median_seconds(forward) / 1e12
                total = 3 * flops / median_seconds(both) / 1e12
                print(f"s {seq:>5} d {width:>3} {'causal' if causal else 'full  '}: forward {fwd:6.1f}, "
                      f"forward+backward {total:6.1f} TFLOP/s as counted ({total / gemm:.0%} of the GEMM's)",
                      flush=True)


if __name__ == "__main__":
    main()
