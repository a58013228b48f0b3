"""The profile of what a plan computes: FSDP's mixed precision runs in the compute dtype without
autocast, a GPU runs ``torch.rms_norm`` as one fused kernel where the CPU profile sees it
decomposed, a GPU's norm backward reads its input and the output's gradient twice, and its
softmax reads a row too long for one warp or a block's shared memory three times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stratagem.advisor.cost.memory import estimate_memory
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.profile.fused import RSTD_BYTES
from stratagem.advisor.profile.profiler import profile_model
from stratagem.plan import Plan, Workload


class Norms(nn.Module):
    """Two norm blocks (the products between them run outside the blocks)."""

    def __init__(self, norm: type[nn.Module] = nn.RMSNorm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(norm(64) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 2
        return x


def test_an_rms_norm_is_counted_as_the_gpus_fused_kernel():
    x = torch.empty(2, 8, 64, device="meta")
    block = profile_model(Norms(), (x,), precision="fp32").blocks[0]
    rows, activation = 2 * 8, 2 * 8 * 64 * 4
    # the kernel saves its input and a float per row, where the decomposition saves fp32 products
    assert block.saved_bytes == activation + rows * RSTD_BYTES
    assert (block.fwd_ops, block.bwd_ops) == (1, 2)  # the kernel; its backward and the weight's reduction
    assert block.fwd_op_bytes == 2 * activation + rows * RSTD_BYTES and block.fwd_param_op_bytes == 64 * 4
    # backward: the input's gradient from the output's gradient, the input and the row's rstd; then
    # the weight's gradient reads the output's gradient and the input again
    assert block.bwd_op_bytes == 3 * activation + rows * RSTD_BYTES + 2 * activation


def test_a_gpus_layer_norm_backward_reads_its_input_and_gradient_again_for_the_weights_gradient():
    x = torch.empty(2, 8, 64, device="meta")
    gpu, cpu = (profile_model(Norms(nn.LayerNorm), (x,), precision="fp32", kernels=kernels).blocks[0]
                for kernels in ("gpu", "cpu"))
    assert gpu.bwd_op_bytes - cpu.bwd_op_bytes == 2 * (2 * 8 * 64 * 4)  # CUDA's second kernel
    assert gpu.fwd_op_bytes == cpu.fwd_op_bytes


class Softmaxes(nn.Module):
    """Softmaxes over rows, after a trained scale."""

    def __init__(self, log: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.softmax = nn.LogSoftmax(-1) if log else nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(x * self.scale)


@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize(("row", "rereads"), [(1024, False), (4096, False), (4099, True), (16384, True)])
def test_a_gpus_softmax_reads_rows_that_fit_no_block_three_times(log: bool, row: int, rereads: bool):
    """fp32 rows of 1,024 fit a warp, 4,096 a block's 48 KiB of shared memory; 4,099 do not split
    into 16-byte vectors, 16,384 do not fit: their forward reads the input twice more. Backward
    reads the gradient again beyond a warp, and softmax's multiplies it by the output first."""
    x = torch.empty(4, row, device="meta")
    gpu, cpu = (profile_model(Softmaxes(log), (x,), precision="fp32", kernels=kernels).segments
                for kernels in ("gpu", "cpu"))
    activation = 4 * row * 4
    assert sum(s.fwd_op_bytes for s in gpu) - sum(s.fwd_op_bytes for s in cpu) == (2 * activation if rereads else 0)
    twice = 0 if row <= 1024 else activation
    assert sum(s.bwd_op_bytes for s in gpu) - sum(s.bwd_op_bytes for s in cpu) == twice + (0 if log else 3 * activation)


def test_a_mixed_profile_carries_the_step_fsdp_runs():
    profile = profile_spec("llama-tiny", seq_len=32)
    variant = profile.in_compute_dtype
    assert profile.precision == "bf16-mixed" and variant.precision == "bf16-true"
    assert variant.saved_bytes < profile.saved_bytes  # the residual stream and norms in 16 bits
    assert profile_spec("llama-tiny", seq_len=32, precision="fp32").in_compute_dtype is None


def test_fsdp_plans_read_the_compute_dtype_profile_and_ddp_plans_the_autocast_one():
    profile = profile_spec("llama-tiny", seq_len=32)
    workload = Workload(global_batch_size=8, seq_len=32)
    fsdp = Plan(dp_shard=2, zero=3, micro_batch_size=4, block_container=profile.block_container)
    ddp = Plan(dp_replicate=2, micro_batch_size=4)
    assert profile.computed_by(fsdp) is profile.in_compute_dtype and profile.computed_by(ddp) is profile
    assert not fsdp.runs_autocast and ddp.runs_autocast
    assert estimate_memory(profile, workload, fsdp) == estimate_memory(profile.in_compute_dtype, workload, fsdp)
    assert estimate_memory(profile, workload, ddp).activations > estimate_memory(profile, workload, fsdp).activations
