"""What the plugins refuse, which mesh they build, which dtypes they cast to and what checkpointing
recomputes; no processes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.plan import MeshAxis, Plan
from stratagem.errors import UsageError
from stratagem.models import get_preset
from stratagem.plugins import apply_activation_checkpointing, apply_param_dtype, apply_plan, autocast_context
from stratagem.plugins.data_parallel import offload_policy
from stratagem.plugins.mesh import check_world_size, data_parallel_axes, mesh_axes

aten = torch.ops.aten


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return get_preset("llama-tiny").build()


@pytest.mark.parametrize(("plan", "message"), [
    (Plan(tp=2), "empty tp_layout"),
    (Plan(pp=2, microbatches=2), "pipeline: its schedule computes the loss on the last stage"),
    (Plan(activation_checkpointing="full"), "names no block_container"),
    (Plan(activation_checkpointing="selective"), "names no block_container"),
    (Plan(activation_checkpointing="selective-op"), "names no block_container"),
])
def test_apply_plan_refuses_what_it_cannot_apply(plan, message):
    with pytest.raises(UsageError, match=message) as error:
        apply_plan(tiny_model(), plan, None)  # refused before the mesh is read
    assert "HINT:" in str(error.value)


def test_checkpointing_refuses_a_container_the_model_lacks():
    plan = Plan(activation_checkpointing="full", block_container="blocks")
    expected = "(?s)'blocks' is not a submodule.*HINT: module lists in this model: 'layers'"
    with pytest.raises(UsageError, match=expected):
        apply_activation_checkpointing(tiny_model(), plan)


def test_world_size_mismatch_shows_the_product():
    plan = Plan(dp_replicate=2, dp_shard=4, zero=3)
    with pytest.raises(UsageError, match=r"pp\(1\) × dp_replicate\(2\) × dp_shard\(4\) × tp\(1\) = 8, "
                                         r"but the world size is 4"):
        check_world_size(plan, world_size=4)


@pytest.mark.parametrize(("plan", "axes", "dp_axes"), [
    (Plan(), {MeshAxis.DP_REPLICATE: 1}, ()),
    (Plan(dp_replicate=4), {MeshAxis.DP_REPLICATE: 4}, (MeshAxis.DP_REPLICATE,)),
    (Plan(dp_shard=4, zero=1), {MeshAxis.DP_SHARD: 4}, (MeshAxis.DP_SHARD,)),
    (Plan(dp_shard=4, zero=3), {MeshAxis.DP_SHARD: 4}, (MeshAxis.DP_SHARD,)),
    (Plan(zero=3, offload="params"), {MeshAxis.DP_SHARD: 1}, (MeshAxis.DP_SHARD,)),
    (Plan(dp_replicate=2, dp_shard=2, zero=2), {MeshAxis.DP_REPLICATE: 2, MeshAxis.DP_SHARD: 2},
     (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD)),
    (Plan(dp_replicate=2, zero=3, offload="params"), {MeshAxis.DP_REPLICATE: 2, MeshAxis.DP_SHARD: 1},
     (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD)),
])
def test_mesh_drops_degree_one_axes_fsdp_needs_none_of(plan, axes, dp_axes):
    assert mesh_axes(plan) == axes
    assert data_parallel_axes(plan) == dp_axes


def test_offload_is_unpinned_without_cuda():
    assert type(offload_policy(Plan(dp_shard=2, zero=3))) is OffloadPolicy
    policy = offload_policy(Plan(dp_shard=2, zero=3, offload="params"))
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False


def test_optimizer_only_offload_is_refused_not_widened():
    with pytest.raises(UsageError, match="FSDP2 has no such policy"):
        offload_policy(Plan(dp_shard=2, zero=3, offload="optimizer"))


@pytest.mark.parametrize(("plan", "dtype"), [
    (Plan(dp_replicate=2, precision="bf16-mixed"), torch.bfloat16),
    (Plan(dp_shard=2, zero=1, precision="fp16-mixed"), torch.float16),
    (Plan(dp_shard=2, zero=2, precision="bf16-mixed"), None),  # FSDP's policy casts instead
    (Plan(dp_replicate=2, precision="fp32"), None),
    (Plan(dp_replicate=2, precision="bf16-true"), None),
])
def test_autocast_only_where_ddp_runs_mixed_precision(plan, dtype):
    context = autocast_context(plan, "cpu")
    assert (context.fast_dtype if isinstance(context, torch.autocast) else None) == dtype


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def ops_in_backward(checkpointing: str) -> Counter:
    """The aten ops that backward runs (gradients plus any recompute) for llama-tiny."""
    model = tiny_model()
    apply_activation_checkpointing(model, Plan(activation_checkpointing=checkpointing, block_container="layers"))
    (tokens,), _ = get_preset("llama-tiny").make_batch(2, 16, generator=torch.Generator().manual_seed(0))
    loss = model(tokens).square().mean()
    with _OpCounter() as counter:
        loss.backward()
    return counter.ops


def test_full_checkpointing_recomputes_whole_blocks_and_selective_spares_the_matmuls():
    none, selective, full = (ops_in_backward(mode) for mode in ("none", "selective", "full"))
    attention, blocks = aten._scaled_dot_product_flash_attention_for_cpu.default, 4
    assert (none[attention], selective[attention], full[attention]) == (0, blocks, blocks)
    assert none[aten.silu.default] == 0 and selective[aten.silu.default] == full[aten.silu.default] == blocks
    assert selective[aten.mm.default] == none[aten.mm.default]  # matmul outputs were saved
    # wq wk wv wo w1 w3 redone; recompute stops early, before w2, whose output backward never reads
    assert full[aten.mm.default] == none[aten.mm.default] + 6 * blocks


def test_selective_op_keeps_attention_and_every_other_matmul():
    """torchtitan's policy: SDPA's output kept, of wq wk wv wo w1 w3 w2 the 2nd, 4th and 6th
    (wk, wo, w3) redone; elementwise operators redone as under selective."""
    none, op_level = ops_in_backward("none"), ops_in_backward("selective-op")
    attention, blocks = aten._scaled_dot_product_flash_attention_for_cpu.default, 4
    assert op_level[attention] == 0 and op_level[aten.silu.default] == blocks
    assert op_level[aten.mm.default] == none[aten.mm.default] + 3 * blocks


@pytest.mark.parametrize(("plan", "norm_dtype"), [
    (Plan(dp_replicate=2, precision="bf16-true"), torch.float32),
    (Plan(dp_shard=2, zero=3, precision="bf16-true"), torch.float32),
    (Plan(dp_shard=2, zero=1, precision="bf16-true"), torch.bfloat16),  # ZeroRedundancyOptimizer: one dtype
])
def test_bf16_true_casts_all_but_batchnorm(plan, norm_dtype):
    model = get_preset("resnet-tiny").build()
    apply_param_dtype(model, plan)
    norm = model.layers[0].bn1
    assert model.layers[0].conv1.weight.dtype == model.fc.weight.dtype == torch.bfloat16
    assert {norm.weight.dtype, norm.bias.dtype, norm.running_mean.dtype, norm.running_var.dtype} == {norm_dtype}
    assert norm.num_batches_tracked.dtype == torch.int64


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointing_updates_batchnorm_statistics_once(checkpointing):
    """Recomputing a block in backward leaves its BatchNorm statistics as the forward left them:
    the same as training without checkpointing (and the same gradients)."""
    def trained(mode: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                                          torch.nn.ReLU()) for _ in range(2)))
        apply_activation_checkpointing(model, Plan(activation_checkpointing=mode, block_container=""))
        model(torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        return {**model.state_dict(), **{f"{n}.grad": p.grad for n, p in model.named_parameters()}}

    plain, checkpointed = trained("none"), trained(checkpointing)
    assert checkpointed.keys() == plain.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=0, atol=0, msg=name)
