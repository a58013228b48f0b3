"""``evaluate``: one plan through both cost models, with the throughput and MFU that follow."""

from __future__ import annotations

from stratagem.advisor.cost.estimate import Estimate, MemoryBreakdown, TimeBreakdown
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.cost.memory import estimate_memory, usable_bytes, usable_host_bytes_per_rank
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.cost.timing import estimate_time, mfu, tokens_per_second


def evaluate(profile: ModelProfile, cluster: Cluster, workload: Workload, plan: Plan, *,
             runtime: str = "torch", memory: MemoryBreakdown | None = None,
             time: TimeBreakdown | None = None) -> Estimate:
    """Predicted per-rank memory and step time of ``plan`` for ``profile`` on ``cluster``.

    ``runtime`` picks the model-state layout (``torch`` or ``deepspeed``, see
    :func:`~stratagem.advisor.cost.memory.state_layout`); ``memory`` and ``time`` reuse breakdowns
    already computed for this plan."""
    plan.check(world_size=cluster.world_size, num_heads=profile.num_heads,
               num_kv_heads=profile.num_kv_heads, num_blocks=len(profile.blocks))
    memory = memory or estimate_memory(profile, workload, plan, runtime=runtime, cluster=cluster)
    time = time or estimate_time(profile, cluster=cluster, workload=workload, plan=plan)
    return Estimate(
        plan=plan, memory=memory, time=time,
        capacity_bytes=usable_bytes(cluster.device.memory_bytes),
        host_capacity_bytes=usable_host_bytes_per_rank(cluster),
        throughput=tokens_per_second(profile, workload=workload, time=time),
        throughput_unit="tokens/s" if (workload.seq_len or profile.seq_len) else "samples/s",
        mfu=mfu(profile, cluster=cluster, workload=workload, plan=plan, time=time),
        device=cluster.device.noun,
    )
