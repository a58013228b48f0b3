"""``stratagem verify``: run the advisor's best plans for a few steps here and compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.advisor.search.targets import TARGETS
from stratagem.cli.common import (
    EXIT_NOTHING_FITS,
    LOCAL_RANKS,
    REPEATS,
    STEPS,
    WARMUP_STEPS,
    add_compile_argument,
    add_model_arguments,
    check_writable,
    compile_constraints,
    file_name,
    model_workload,
    positive_int,
    profile_phase,
    seconds,
)

if TYPE_CHECKING:
    from rich.table import Table

    from stratagem.advisor.search.advice import Advice
    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.advisor.hardware import Cluster
    from stratagem.progress import Progress
    from stratagem.verify import Verified


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``verify`` subcommand."""
    parser = subparsers.add_parser(
        "verify",
        help="run the advisor's best plans for a few steps on this host: predicted vs measured",
        description="Advise for this host (its GPUs, or --nproc CPU ranks on gloo; under torchrun or a "
        "Slurm step, the job's ranks), then train each of the K best plans for a few steps in its own "
        "processes, measuring the step time and the peak "
        "memory per rank (CUDA: max allocated; CPU: peak resident memory above the process's size "
        "before the model). Prints predicted against measured, with the spread of the measured steps, "
        "and writes the measured winner (fastest median step) as a "
        "plan file that auto-parallel and the exporters accept. A plan that fails is reported; "
        "the others go on. Runs every model advise takes: a preset, a factory (built for real in each rank, "
        "trained on its example inputs with its loss) or an hf: config (random weights and tokens, the "
        "model's own loss). Progress goes to stderr as it happens; the table to stdout.",
    )
    add_model_arguments(parser)
    parser.add_argument("--nproc", type=LOCAL_RANKS, default=None, metavar="N",
                        help="CPU ranks when there is no GPU (default: 2); with GPUs, all of them")
    parser.add_argument("--top", type=positive_int, default=3, metavar="K", help="plans to run (default: 3)")
    parser.add_argument("--target", choices=TARGETS, default="any", help="runtime the plans must suit (default: any)")
    parser.add_argument("--steps", type=STEPS, default=3, help="measured steps per plan (default: 3)")
    parser.add_argument("--warmup", type=WARMUP_STEPS, default=1, metavar="N",
                        help="warm-up steps before measuring (default: 1); every plan runs at least the steps its "
                        "memory peak is read over, then one more, whatever N is")
    parser.add_argument("--repeats", type=REPEATS, default=1, metavar="N",
                        help="run every plan N times in fresh processes, round by round, and pool their steps "
                        "(default: 1)")
    parser.add_argument("--timeout", type=seconds, default=300.0, metavar="S",
                        help="seconds one plan may run (default: 300)")
    parser.add_argument("--output", type=file_name, default=None, metavar="FILE",
                        help="write the measured winner's plan here (JSON)")
    parser.add_argument("--no-calibration", dest="calibration", action="store_false",
                        help="use catalog figures even when `stratagem calibrate` measured this host")
    add_compile_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Advise for this host, run the top plans, report; returns the exit status."""
    import torch

    from stratagem.advisor.hardware import parse_cluster, probe_local
    from stratagem.distributed import launched_job
    from stratagem.errors import UsageError

    check_writable(args.output, "the measured winner's plan")
    if launched_job():
        return _run_in_job(args)
    if torch.cuda.is_available():
        if args.nproc is not None:
            raise UsageError("--nproc applies to CPU ranks; with GPUs every GPU runs\nHINT: set CUDA_VISIBLE_DEVICES")
        cluster = probe_local()
    else:
        cluster = parse_cluster(f"{args.nproc or 2}xcpu")
    return _advise_and_verify(cluster, args)


def _run_in_job(args: argparse.Namespace) -> int:
    """``verify`` as one rank of a launched job (``torchrun … -m stratagem verify``): advise for
    the job's cluster as its ranks probe it, and run each plan on the job's ranks
    (:func:`~stratagem.verify.verify_plan`); rank 0 reports."""
    import torch.distributed as dist

    from stratagem.distributed import init_process_group, leaving_process_group
    from stratagem.advisor.hardware import gather_cluster, probe_local
    from stratagem.errors import UsageError

    if args.nproc is not None:
        raise UsageError("--nproc applies to a verify that spawns its ranks; in a launched job every rank runs\n"
                         "HINT: the launcher's --nproc-per-node sets the ranks")
    init_process_group("gloo")  # the plans run in groups of their own: this one only coordinates
    with leaving_process_group():
        code = _advise_and_verify(gather_cluster(probe_local()), args, report=dist.get_rank() == 0)
    return code


def _advise_and_verify(cluster: Cluster, args: argparse.Namespace, *, report: bool = True) -> int:
    """Advise for ``cluster`` (its stored calibration applied unless ``--no-calibration``) and
    verify the top plans; only a ``report``ing rank prints (progress on stderr)."""
    from stratagem.advisor.calibrate import calibrated
    from stratagem.advisor.search.advice import advise
    from stratagem.progress import Progress

    with Progress(enabled=report) as display:
        cluster = calibrated(cluster) if args.calibration else cluster
        with display.phase("profile", profile_phase(args)):
            profile, workload = model_workload(args, cluster)
        with display.phase("search", f"plans for {cluster.spec}, global batch {workload.global_batch_size}") as phase:
            advice = advise(profile, cluster, workload, top=args.top, target=args.target, objective=args.objective,
                            constraints={**compile_constraints(args), **_fixed_batch(args.model, profile)})
            phase.done(f"{advice.num_evaluated} plans costed, {len(advice.plans)} to run")
        if advice.best is None:
            from stratagem.advisor.report.render import render_table
            from rich.console import Console

            display.close()
            if report:
                Console().print(render_table(advice))
            return EXIT_NOTHING_FITS
        return verify_advice(advice, args, top=args.top, output=args.output, report=report, display=display)


def _fixed_batch(spec: str, profile: ModelProfile) -> dict[str, int]:
    """The plans a factory without a ``batch_size`` parameter can feed, as search constraints: each
    forward takes the batch its inputs hold (no plan ranked could run it otherwise)."""
    from stratagem.advisor.profile.cache import is_factory
    from stratagem.advisor.profile.sources import factory_arguments, load_factory

    if not is_factory(spec):
        return {}
    takes_batch = "batch_size" in factory_arguments(spec, load_factory(spec), batch_size=1, seq_len=None)
    return {} if takes_batch else {"micro_batch_size": profile.batch_size, "microbatches": 1}


def verify_advice(advice: Advice, args: argparse.Namespace, *, top: int, output: Path | None,
                  report: bool = True, display: Progress | None = None) -> int:
    """Run the ``top`` plans of ``advice`` here (this host, or the launched job's ranks) and print
    predicted against measured (only where ``report``); exit status 0 when one ran, 1 when none
    did. ``args`` carries the model arguments; ``display`` (by default a new one) shows the
    plans' progress on stderr."""
    from rich.console import Console

    from stratagem.distributed import launched_job
    from stratagem.progress import Progress
    from stratagem.verify import measured_winner, verify_estimates

    if not launched_job():
        check_this_host(advice.cluster)
    estimates = advice.plans[:top]
    display = display or Progress(enabled=report)

    repeats = getattr(args, "repeats", 1)

    def progress(index: int, result: Verified) -> None:
        measured = result.measured
        state = "failed: " + (result.error or "") if measured is None else (
            f"{measured.step_seconds:.3g} s/step (steps {measured.fastest:.3g}–{measured.slowest:.3g})")
        run = f" run {measured.repeats}/{repeats}" if measured is not None and repeats > 1 else ""
        display.line(f"verify [{index + 1}/{len(estimates)}]{run} {result.plan.name}: {state}")

    with display:
        results = verify_estimates(args.model, estimates, seq_len=advice.workload.seq_len,
                                   optimizer=advice.workload.optimizer, grad_clip=advice.workload.grad_clip,
                                   steps=getattr(args, "steps", 3),
                                   warmup=getattr(args, "warmup", 1), timeout=getattr(args, "timeout", 300.0),
                                   repeats=repeats, progress=progress if report else None, display=display)
    winner = measured_winner(results)
    if not report:
        return 0 if winner is not None else EXIT_NOTHING_FITS
    Console().print(verification_table(results, cluster=advice.cluster))
    if winner is None:
        return EXIT_NOTHING_FITS
    print(winner_line(results, winner))
    if output is not None:
        output.write_text(winner.plan.to_json(indent=1) + "\n")
        print(f"wrote the plan to {output} (Trainer(strategy=AutoParallelStrategy(plan=...)), advise --emit)",
              file=sys.stderr)
    return 0


def check_this_host(cluster: Cluster) -> None:
    """:class:`UsageError` unless ``cluster`` can be this host (one node; GPUs only with CUDA;
    no TPU chips, which torch_xla drives)."""
    import torch

    from stratagem.errors import UsageError

    cluster.check_runnable("verify")
    if cluster.num_nodes > 1 or (cluster.is_gpu and not torch.cuda.is_available()):
        raise UsageError(f"verify runs plans on this host; {cluster.spec} is not it\n"
                         "HINT: --cluster local, or Nxcpu for N CPU ranks")


def winner_line(results: list[Verified], winner: Verified) -> str:
    """The measured winner (by median step), where the advisor ranked it, and the plans whose
    measured steps' range overlaps its own (too close to call at the noise measured)."""
    from stratagem.verify import too_close_to_call

    line = f"measured winner: {winner.plan.name} (median step)"
    if winner is not results[0]:
        line += f"; the advisor ranked it #{results.index(winner) + 1}"
    close = too_close_to_call(results, winner)
    if close:
        names = ", ".join(r.plan.name for r in close)
        line += (f"; its steps' range overlaps {names}'s: too close to call at this noise "
                 "(HINT: more --steps or --repeats)")
    return line


def verification_table(results: list[Verified], *, cluster: Cluster) -> Table:
    """Predicted against measured on ``cluster``, one row per plan; beside the step time's error,
    the measured steps' spread (their range over their median), which says what of it is noise;
    under it, the cluster's notes (whether a calibration gave the predictions' rates)."""
    from rich.table import Table

    from stratagem.units import format_bytes, format_seconds

    table = Table(title=f"predicted vs measured on {cluster.spec} (step time: slowest rank; memory: fullest rank)")
    for column in ("#", "plan", "step pred.", "step meas.", "spread", "err", "memory pred.", "memory meas.", "err"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for index, result in enumerate(results, 1):
        predicted = (format_seconds(result.estimate.time.step_seconds), format_bytes(result.estimate.memory.total))
        if result.measured is None:
            table.add_row(str(index), result.plan.name, predicted[0], "[red]failed[/]", "", "", predicted[1],
                          result.error or "", "")
            continue
        table.add_row(str(index), result.plan.name, predicted[0], format_seconds(result.measured.step_seconds),
                      f"{result.measured.spread:.0%}", f"{result.time_error:+.0%}", predicted[1],
                      format_bytes(result.measured.peak_bytes),
                      "" if result.memory_error is None else f"{result.memory_error:+.0%}")
    table.caption = "\n".join((*_caption(results), *cluster.notes))
    return table


def _caption(results: list[Verified]) -> list[str]:
    """What the spread covers, compiled plans whose blocks broke into pieces, and the first-time
    sharding decisions left out of the steps."""
    from stratagem.units import format_seconds

    ran = [r.measured for r in results if r.measured is not None]
    lines = []
    if ran:
        runs = ran[0].repeats
        over = f"{ran[0].steps} steps" + (f" × {runs} runs" if runs > 1 else "")
        lines.append(f"spread: (slowest − fastest step) / median step, over {over} per plan; a step error "
                     "smaller than it may be noise")
    for result in results:
        if result.measured is not None and result.measured.graph_breaks:
            lines.append(f"{result.plan.name}: torch.compile broke its blocks into pieces "
                         f"({result.measured.graph_breaks} graph breaks; the first: "
                         f"{result.measured.graph_break.splitlines()[0] if result.measured.graph_break else '?'}): "
                         "the advisor predicts whole compiled blocks")
    sharding = max((m.sharding_seconds for m in ran), default=0.0)
    if sharding > 0:
        lines.append(f"measured steps leave out DTensor's first sharding decisions for new shapes (up to "
                     f"{format_seconds(sharding)} a step): a warm-up cost (which a mixture of experts pays again "
                     "while routing yields new expert row counts); the advisor predicts the steady state")
    return lines
