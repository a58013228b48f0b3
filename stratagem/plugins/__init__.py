"""Apply a Plan with torch-native composable APIs on a DeviceMesh.

Typical use, on every rank once the process group is up::

    mesh = build_mesh(plan, device_type="cpu")
    model = apply_plan(model, plan, mesh)
    optimizer = build_optimizer(model, plan, torch.optim.AdamW, lr=1e-3)
    with vocab_parallel_loss(plan):  # where the plan leaves the logits on vocabulary shards
        with autocast_context(plan, "cpu"):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
    clip_grad_norm_(model.parameters(), 1.0)  # optional: the whole model's norm, on any plan

``apply_plan`` (in :mod:`stratagem.plugins.apply`) documents the order the techniques are
applied in. Applied today: DDP, ZeRO-1 (``ZeroRedundancyOptimizer``), FSDP2 (ZeRO-2/3, HSDP),
CPU offload (its optimizer stepping fused on the host: :mod:`stratagem.plugins.host_optimizer`),
activation checkpointing (full and selective), precision, and tensor and sequence
parallelism from the Plan's ``tp_layout`` (alone or under FSDP/HSDP; DDP with TP is refused).
Pipeline parallelism (``pp > 1``): ``apply_plan`` returns this rank's
:class:`~stratagem.plugins.pipeline.Pipeline` (stages and schedule)::

    pipe = apply_plan(model, plan, mesh, loss_fn=loss_fn, example_inputs=one_micro_batch)
    optimizer = build_optimizer(pipe.modules, plan, torch.optim.AdamW, lr=1e-3)
    loss = pipe.step(*inputs, target=targets)  # forward + backward of all micro-batches
    pipe.clip_grad_norm_(1.0)  # optional: over every stage
    optimizer.step(); optimizer.zero_grad()

This package imports :mod:`stratagem.plan` (the Plan, precisions, how stages are built) and
nothing of the advisor.
"""

from stratagem.plugins.apply import apply_plan, check_applicable, check_plan_fits
from stratagem.plugins.checkpointing import apply_activation_checkpointing
from stratagem.plugins.compile import apply_compile
from stratagem.plugins.data_parallel import apply_data_parallel, build_optimizer
from stratagem.plugins.grad_norm import clip_grad_norm_, clip_grad_value_
from stratagem.plugins.host_optimizer import fuse_host_optimizer
from stratagem.plugins.mesh import build_mesh
from stratagem.plugins.pipeline import Pipeline
from stratagem.plugins.precision import apply_param_dtype, autocast_context
from stratagem.plugins.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss

__all__ = [
    "Pipeline",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_data_parallel",
    "apply_param_dtype",
    "apply_plan",
    "apply_tensor_parallel",
    "autocast_context",
    "build_mesh",
    "build_optimizer",
    "fuse_host_optimizer",
    "check_applicable",
    "clip_grad_norm_",
    "clip_grad_value_",
    "check_plan_fits",
    "vocab_parallel_loss",
]
