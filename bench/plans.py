"""A plan the bench scripts give as a dict, completed as ``--plan`` completes one
(``python bench/NAME.py`` puts this folder on sys.path)."""

from __future__ import annotations

import json
from typing import Any

from stratagem.advisor.hardware import Cluster
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.search.given_plans import complete_plan, read_plan
from stratagem.plan import Plan, Workload


def given_plan(fields: dict[str, Any], profile: ModelProfile, cluster: Cluster, workload: Workload) -> Plan:
    """``fields`` as a plan on ``cluster``, what they leave out completed for ``profile`` and ``workload``."""
    return complete_plan(read_plan(json.dumps(fields), label="A", source="bench"), profile, cluster, workload)
