"""``stratagem explain --model MODEL --plan A [--plan B]``: why not plan X? Two plans side by side,
term by term, and why one wins; with one ``--plan``, that plan against the advisor's best.

Exit status: 0 with the comparison (a plan that does not fit is part of the answer), 2 for usage
errors, a plan that cannot train this workload on this cluster included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.cli.common import add_model_arguments
from stratagem.errors import UsageError

if TYPE_CHECKING:
    from stratagem.advisor.hardware import Cluster
    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.advisor.search.given_plans import Comparison, GivenPlan
    from stratagem.plan import Plan, Workload

FORMATS = ("table", "json")
DEFAULT_PRECISION = "bf16-mixed"
INLINE_EXAMPLE = '\'{"dp_shard": 8, "zero": 3, "micro_batch_size": 4}\''


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``explain`` subcommand."""
    parser = subparsers.add_parser(
        "explain",
        help="why not plan X? two plans' memory and time side by side, term by term",
        description="Cost two plans for MODEL on the cluster and set their memory and time terms side by "
        "side with the difference, then say which terms decide between them. With one --plan, compare it "
        "with the advisor's best plan. Fields a plan leaves out take the search's choices for the model "
        "(precision, block container, tensor-parallel layout, balanced pipeline stages).",
    )
    add_model_arguments(parser, plan_defaults=True)
    parser.add_argument("--cluster", metavar="SPEC", default="local",
                        help="cluster spec such as '8xA100', '4x8xH100:ib-ndr', or 'local' to probe this "
                        "machine (default: local)")
    parser.add_argument("--plan", action="append", required=True, metavar="PLAN",
                        help="a plan JSON file (a Plan's fields, or `advise --format json` output or one of its "
                        f"entries) or an inline JSON object such as {INLINE_EXAMPLE}; give it once to compare "
                        "with the advisor's best, twice to compare two plans")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    parser.add_argument("--no-calibration", dest="calibration", action="store_false",
                        help="use catalog figures even when `stratagem calibrate` measured this cluster")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Read the plans, profile, check and cost them, print the comparison; returns 0."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.given_plans import LABELS, complete_plan, compare_plans, read_plan
    from stratagem.cli.common import model_workload

    if len(args.plan) > 2:
        raise UsageError(f"explain compares two plans, got {len(args.plan)} --plan options\n"
                         "HINT: give --plan twice, or once to compare it with the advisor's best")
    given = [read_plan(_plan_text(value, label), label=label, source=_source(value))
             for label, value in zip(LABELS, args.plan)]
    cluster = parse_cluster(args.cluster)
    if args.calibration:
        cluster = calibrated(cluster)
    first = given[0]
    args.precision = args.precision or first.fields.get("precision") or DEFAULT_PRECISION
    args.global_batch_size = args.global_batch_size or first.plan.global_batch_size
    profile, workload = model_workload(args, cluster)
    plans = [complete_plan(g, profile, cluster, workload) for g in given]
    sources = [g.source for g in given]
    if len(plans) == 1:
        plans.append(_best_plan(profile, cluster, workload, args.objective, given[0]))
        sources.append("the advisor's best")
    comparison = compare_plans(profile, cluster, workload, (plans[0], plans[1]), sources=(sources[0], sources[1]),
                               objective=args.objective)
    _write(comparison, args.format)
    return 0


def _plan_text(value: str, label: str) -> str:
    """The JSON of ``--plan``: inline when it starts with ``{``, else the file it names."""
    if value.lstrip().startswith("{"):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise UsageError(f"plan {label}: cannot read the plan file {value}: {reason}\nHINT: give a JSON file of "
                         f"Plan fields (or `advise --format json` output), or an inline object such as "
                         f"{INLINE_EXAMPLE}") from None


def _source(value: str) -> str:
    return "inline" if value.lstrip().startswith("{") else value


def _best_plan(profile: ModelProfile, cluster: Cluster, workload: Workload, objective: str, given: GivenPlan) -> Plan:
    """The advisor's best plan for the workload, to compare ``given`` with."""
    from stratagem.advisor.search.advice import advise

    best = advise(profile, cluster, workload, top=1, objective=objective).best
    if best is None:
        raise UsageError(f"no plan fits {profile.name} on {cluster.spec}, so there is no best plan to compare "
                         f"{given.title} with\nHINT: give a second --plan, or see `stratagem advise` for what "
                         "would make it fit")
    return best.plan


def _write(comparison: Comparison, fmt: str) -> None:
    """Print ``comparison`` as a table or JSON on standard output."""
    from stratagem.advisor.report.compare import render_comparison_json, render_comparison_table

    if fmt == "json":
        sys.stdout.write(render_comparison_json(comparison) + "\n")
        return
    from rich.console import Console

    Console().print(render_comparison_table(comparison))
