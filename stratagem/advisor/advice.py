"""Advice: what ``advise`` returns — ranked, costed plans with the reasons behind the ranking."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from stratagem.advisor.estimate import Estimate
from stratagem.advisor.hardware import Cluster
from stratagem.advisor.plan import Workload
from stratagem.advisor.model_profile import ModelProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class Advice:
    """The advisor's answer for one model, cluster and workload.

    ``plans`` are the top fitting plans, best first (empty when nothing fits; then
    ``suggestions`` say what would make the model fit). ``reasons`` explain the winner and why
    the runner-up loses; ``excluded`` counts the plans the target runtime cannot run, by reason;
    ``notes`` carry caveats from the profile and the cluster. ``overall`` is the best plan with
    no target restriction, when a target restricted the search (see :meth:`against`).
    """

    profile: ModelProfile
    cluster: Cluster
    workload: Workload
    target: str
    plans: tuple[Estimate, ...]
    reasons: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    excluded: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    num_evaluated: int = 0
    search_seconds: float = 0.0
    overall: Estimate | None = None

    @property
    def best(self) -> Estimate | None:
        """The recommended plan, or None when nothing fits."""
        return self.plans[0] if self.plans else None

    def against(self, overall: Estimate | None) -> Advice:
        """This advice with ``overall``, the best plan of the unrestricted search, to say what
        the target's restriction costs."""
        return replace(self, overall=overall)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``advise --format json``."""
        p = self.profile
        return {
            "model": {"name": p.name, "parameters": p.num_params, "flops_per_step": p.flops_per_step,
                      "profiled_batch_size": p.batch_size, "seq_len": p.seq_len,
                      "num_blocks": len(p.blocks), "num_heads": p.num_heads, "num_kv_heads": p.num_kv_heads},
            "cluster": self.cluster.to_dict(),
            "workload": self.workload.to_dict(),
            "target": self.target,
            "plans": [e.to_dict() for e in self.plans],
            "reasons": list(self.reasons),
            "suggestions": list(self.suggestions),
            "excluded": dict(self.excluded),
            "notes": list(self.notes),
            "num_evaluated": self.num_evaluated,
            "search_seconds": self.search_seconds,
            "overall": self.overall.to_dict() if self.overall else None,
        }
