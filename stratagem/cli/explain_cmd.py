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
                        help="a plan's name as `advise` prints it (e.g. 'fsdp8 zero3 mb=4'; '.' for '·'), a plan "
                        "JSON file (a Plan's fields, or `advise --format json` output or one of its entries) or "
                        f"an inline JSON object such as {INLINE_EXAMPLE}; give it once to compare with the "
                        "advisor's best, twice to compare two plans")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    parser.add_argument("--no-calibration", dest="calibration", action="store_false",
                        help="use catalog figures even when `stratagem calibrate` measured this cluster")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Read the plans, profile, check and cost them, print the comparison; returns 0."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.given_plans import LABELS, complete_plan, compare_plans, named_plan
    from stratagem.cli.common import model_workload

    if len(args.plan) > 2:
        raise UsageError(f"explain compares two plans, got {len(args.plan)} --plan options\n"
                         "HINT: give --plan twice, or once to compare it with the advisor's best")
    given = [_read(value, label) for label, value in zip(LABELS, args.plan)]
    cluster = parse_cluster(args.cluster)
    if args.calibration:
        cluster = calibrated(cluster)
    first = next((g for g in given if not isinstance(g, str)), None)
    args.precision = args.precision or (first and first.fields.get("precision")) or DEFAULT_PRECISION
    args.global_batch_size = args.global_batch_size or (first and first.plan.global_batch_size)
    if not args.global_batch_size:
        raise UsageError(f"a plan given by name ({given[0]}) does not say its global batch\n"
                         "HINT: give --global-batch-size, the one `advise` was given")
    profile, workload = model_workload(args, cluster)
    plans = [named_plan(g, profile, cluster, workload, label=label) if isinstance(g, str)
             else complete_plan(g, profile, cluster, workload) for label, g in zip(LABELS, given)]
    sources = [_source(value) for value in args.plan]
    if len(plans) == 1:
        plans.append(_best_plan(profile, cluster, workload, args.objective, f"plan {LABELS[0]} ({sources[0]})"))
        sources.append("the advisor's best")
    comparison = compare_plans(profile, cluster, workload, (plans[0], plans[1]), sources=(sources[0], sources[1]),
                               objective=args.objective)
    _write(comparison, args.format)
    return 0


def _read(value: str, label: str) -> GivenPlan | str:
    """``--plan``'s plan: read from inline JSON or a file, or the name it gives a plan by, to find
    among the search's once the model is profiled (a value that is neither: no such file, no
    path separator, no ``.json``)."""
    from stratagem.advisor.search.given_plans import read_plan

    if not value.strip():
        raise UsageError(f"plan {label}: --plan is empty\nHINT: give a plan's name as `advise` prints it, a JSON "
                         f"file, or an inline object such as {INLINE_EXAMPLE}")
    if _names_a_plan(value):
        return value
    return read_plan(_plan_text(value, label), label=label, source=_source(value))


def _names_a_plan(value: str) -> bool:
    text = value.strip()
    return not (_inline(text) or "/" in text or text.endswith(".json") or _is_file(text))


def _inline(value: str) -> bool:
    """Whether ``--plan`` gives JSON inline: an object, or a list (which the plan reader refuses)."""
    return value.lstrip().startswith(("{", "["))


def _is_file(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # too long a name, a NUL byte: no file of that name
        return False


def _plan_text(value: str, label: str) -> str:
    """The JSON of ``--plan``: inline (:func:`_inline`), else the file it names."""
    if _inline(value):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or err
        raise UsageError(f"plan {label}: cannot read the plan file {value}: {reason}\nHINT: give a JSON file of "
                         f"Plan fields (or `advise --format json` output), or an inline object such as "
                         f"{INLINE_EXAMPLE}") from None


def _source(value: str) -> str:
    if _names_a_plan(value):
        return "by name"
    return "inline" if _inline(value) else value


def _best_plan(profile: ModelProfile, cluster: Cluster, workload: Workload, objective: str, title: str) -> Plan:
    """The advisor's best plan for the workload, to compare the plan ``title`` names with."""
    from stratagem.advisor.search.advice import advise

    best = advise(profile, cluster, workload, top=1, objective=objective).best
    if best is None:
        raise UsageError(f"no plan fits {profile.name} on {cluster.spec}, so there is no best plan to compare "
                         f"{title} with\nHINT: give a second --plan, or see `stratagem advise` for what "
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
