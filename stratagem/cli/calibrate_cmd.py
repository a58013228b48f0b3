"""``stratagem calibrate``: measure this cluster so the cost model uses measured figures."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from stratagem.cli.common import LOCAL_RANKS, check_writable, file_name

if TYPE_CHECKING:
    from rich.table import Table

    from stratagem.advisor.calibrate import Calibration


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``calibrate`` subcommand."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure matmul rates, memory bandwidth and collectives on this cluster",
        description="Run short micro-benchmarks with the real backend (NCCL on GPUs, gloo on CPU): "
        "matmul FLOP/s per dtype and size, memory bandwidth, latency and bandwidth of all-reduce, "
        "all-gather, reduce-scatter and point-to-point per group size inside a node and across "
        "nodes, and how much communication hides under compute. The result is stored keyed to this "
        "hardware; advise and auto-parallel use it whenever they plan for the same cluster. Run it "
        "under torchrun/srun to measure every node of a job, or alone to spawn local processes.",
    )
    parser.add_argument("--nproc", type=LOCAL_RANKS, default=None, metavar="N",
                        help="local processes to spawn when not launched (default: the GPUs, or 2 CPU ranks)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds, rougher)")
    parser.add_argument("--output", type=file_name, default=None, metavar="FILE",
                        help="write the calibration here instead of the cache where advise finds it")
    parser.add_argument("--json", action="store_true", help="print the calibration as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Calibrate, store and summarise; returns the exit status."""
    from stratagem.advisor.calibrate.calibration import calibration_path
    from stratagem.distributed import launched_job
    from stratagem.advisor.calibrate.run import calibrate

    check_writable(args.output, "the calibration")
    result = calibrate(nproc=args.nproc, quick=args.quick, progress=True)  # on stderr: stdout keeps the result
    if launched_job() and int(os.environ["RANK"]) != 0:
        return 0  # every rank of a job measured; rank 0 stores and reports
    path = args.output or calibration_path(result.hardware)
    result.save(path)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    from rich.console import Console

    console = Console()
    console.print(calibration_table(result))
    console.print(f"saved to {path}" + ("" if args.output else " (advise and auto-parallel use it for this cluster)"))
    return 0


def calibration_table(calibration: Calibration) -> Table:
    """What was measured, one row per figure."""
    from rich.table import Table

    from stratagem.units import format_bytes, format_seconds

    table = Table(title=f"calibration of {calibration.hardware} ({calibration.backend}, "
                        f"{calibration.world_size} ranks, {calibration.seconds:.1f} s)")
    table.add_column("measured", style="bold")
    table.add_column("value", justify="right")
    for dtype, points in calibration.matmul.items():
        rates = ", ".join(f"{n}: {rate / 1e12:.3g}" for n, rate in points)
        table.add_row(f"matmul {dtype} (n: TFLOP/s)", rates)
        if dtype in calibration.unaligned_matmul:
            table.add_row(f"… rows off 16 bytes ({dtype})", f"{calibration.unaligned_matmul[dtype]:.0%} of that rate")
    for dtype, points in calibration.conv.items():
        rates = ", ".join(f"{intensity:.0f}: {rate / 1e12:.3g}" for intensity, rate in points)
        table.add_row(f"convolutions {dtype} (FLOP/B: TFLOP/s)", rates)
    table.add_row("memory bandwidth", f"{format_bytes(calibration.memory_bandwidth)}/s")
    if calibration.memory_latency is not None:
        table.add_row("memory latency, few loads in flight", format_seconds(calibration.memory_latency))
    for scope, ops in calibration.links.items():
        for op, fits in ops.items():
            for size, fit in sorted(fits.items()):
                table.add_row(f"{op} {scope} ×{size} (α, β)",
                              f"{format_seconds(fit.latency)}, {format_bytes(fit.bandwidth)}/s")
    if calibration.overlap is not None:
        table.add_row("comm hidden under compute", f"{calibration.overlap:.0%}")
    if calibration.op_seconds is not None:
        table.add_row("host time per operator", format_seconds(calibration.op_seconds))
    if calibration.op_byte_seconds is not None:
        table.add_row("… per MiB moved without FLOPs", format_seconds(calibration.op_byte_seconds * 2**20))
    table.add_row("… per TP Linear on DTensors (fwd + bwd)", format_seconds(calibration.tp_linear_seconds))
    for where, measured in (("", calibration.optimizer_seconds), (" on the host", calibration.host_optimizer_seconds)):
        for name, (per_param, per_tensor) in (measured or {}).items():
            table.add_row(f"{name} step{where} per M params, per tensor",
                          f"{format_seconds(per_param * 1e6)}, {format_seconds(per_tensor)}")
    if calibration.dtensor_optimizer_seconds is not None:
        per_step, per_tensor = calibration.dtensor_optimizer_seconds
        table.add_row("adamw step on DTensors per step, per tensor",
                      f"{format_seconds(per_step)}, {format_seconds(per_tensor)}")
    for size, wait in sorted((calibration.sync_seconds or {}).items()):
        table.add_row(f"collective's wait after compute ×{size}", format_seconds(wait))
    if calibration.framework_bytes is not None:
        table.add_row("framework memory per rank", format_bytes(calibration.framework_bytes))
    table.caption = "\n".join(calibration.notes) or None
    return table
