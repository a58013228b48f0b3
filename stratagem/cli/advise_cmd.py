"""``stratagem advise --model MODEL``: the best ways to parallelize a model on a cluster.

Exit status: 0 with a recommended plan, 1 when nothing fits (the report still says what would
make it fit), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.advisor.search.targets import TARGETS  # light: the planning modules import no torch
from stratagem.cli.common import (
    EXIT_NOTHING_FITS,
    add_compile_argument,
    add_model_arguments,
    check_writable,
    compile_constraints,
    file_name,
    model_workload,
    positive_int,
    profile_phase,
)
from stratagem.cli.emit import EMIT_FILES, export_config, search_target

if TYPE_CHECKING:
    from stratagem.advisor.search.advice import Advice

FORMATS = ("table", "json", "markdown", "html")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``advise`` subcommand."""
    parser = subparsers.add_parser(
        "advise",
        help="rank ways to parallelize a model on a cluster, with memory and time per plan",
        description="Search tensor, pipeline and data parallelism, ZeRO stages, activation "
        "checkpointing and micro-batching for MODEL on the cluster; print the best plans with "
        "their memory per GPU and time per step, and why they win.",
    )
    add_model_arguments(parser)
    parser.add_argument("--cluster", metavar="SPEC", default="local",
                        help="cluster spec such as '8xA100', '4x8xH100:ib-ndr', or 'local' to probe "
                        "this machine (default: local)")
    parser.add_argument("--top", type=positive_int, metavar="K", default=5, help="plans to show (default: 5)")
    parser.add_argument("--target", choices=TARGETS, default=None,
                        help="keep only plans this runtime can run; the report says what that costs against "
                        "the best plan overall (default: the --emit runtime, else any)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="report format (default: table)")
    parser.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    parser.add_argument("--output", metavar="FILE", type=file_name, default=None,
                        help="write the report to FILE instead of standard output; with --emit, FILE is "
                        "the config file and the report goes to standard output")
    parser.add_argument("--emit", choices=tuple(EMIT_FILES), default=None,
                        help="also write the best plan as this runtime's config: an `accelerate launch` "
                        "YAML (with --target deepspeed: DeepSpeed through Accelerate), a DeepSpeed JSON, or "
                        "Lightning Trainer arguments as a LightningCLI YAML; to --output, default "
                        + ", ".join(f"{name} for {runtime}" for runtime, name in EMIT_FILES.items()))
    parser.add_argument("--no-calibration", dest="calibration", action="store_false",
                        help="use catalog figures even when `stratagem calibrate` measured this cluster")
    add_compile_argument(parser)
    parser.add_argument("--verify", type=positive_int, metavar="K", default=None,
                        help="then run the K best plans for a few steps on this host and compare "
                        "(the cluster must be this host: 'local' or 'Nxcpu'; see `stratagem verify`)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Profile, search and report; returns the exit status."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.search.advice import advise
    from stratagem.progress import Progress

    check_writable(args.output, "the config" if args.emit else "the report")
    target = search_target(emit=args.emit, target=args.target)
    cluster = parse_cluster(args.cluster)
    if args.emit:
        cluster.check_runnable(f"--emit {args.emit}")
    if args.verify:
        from stratagem.distributed import launched_job
        from stratagem.cli.verify_cmd import check_this_host
        from stratagem.errors import UsageError

        if launched_job():
            raise UsageError("advise --verify spawns the plans' ranks on this host; in a launched job each rank "
                             "runs its own\nHINT: torchrun ... -m stratagem verify --model ... (the job's cluster "
                             "is advised for)")
        check_this_host(cluster)
    if args.calibration:
        cluster = calibrated(cluster)
    constraints = compile_constraints(args)
    with Progress() as display:  # on stderr: the report goes to stdout once it is done
        with display.phase("profile", profile_phase(args)):
            profile, workload = model_workload(args, cluster)
        with display.phase("search", f"plans for {cluster.spec}, global batch {workload.global_batch_size}") as phase:
            advice = advise(profile, cluster, workload, top=args.top, target=target, objective=args.objective,
                            constraints=constraints)
            if target != "any":  # what the target's restriction costs
                advice = advice.against(advise(profile, cluster, workload, top=1, target="any",
                                               constraints=constraints).best)
            phase.done(f"{advice.num_evaluated} plans costed")
    _write(advice, args.format, None if args.emit else args.output)
    if args.emit and advice.best:
        export_config(args.emit, advice, args.output)
    if args.verify and advice.best:
        from stratagem.cli.verify_cmd import verify_advice

        return verify_advice(advice, args, top=args.verify, output=None)
    return 0 if advice.best else EXIT_NOTHING_FITS


def _write(advice: Advice, fmt: str, output: Path | None) -> None:
    """Render ``advice`` in ``fmt`` to ``output`` (a file) or standard output."""
    from rich.console import Console

    from stratagem.advisor.report import render as report
    from stratagem.errors import UsageError

    if fmt == "table" and output is None:
        Console().print(report.render_table(advice))
        return
    if fmt == "table":
        buffer = io.StringIO()
        Console(file=buffer, width=120, force_terminal=False).print(report.render_table(advice))
        text = buffer.getvalue()
    else:
        text = {"json": report.render_json, "markdown": report.render_markdown, "html": report.render_html}[fmt](advice)
    text = text if text.endswith("\n") else text + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the report to {output}: {err.strerror}\n"
                         "HINT: give --output a path in a folder that exists and is writable") from None
    print(f"advise: wrote the {fmt} report to {output}", file=sys.stderr)
