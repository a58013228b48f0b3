"""Run plans for real and set what they measured beside what the advisor predicted.

Each plan runs in its own set of spawned processes (gloo on CPU, NCCL on GPUs): on this host, or
inside a launched job (torchrun, a Slurm step) one per rank of the job on its node, the job's own
ranks only agreeing on where the new group meets and gathering what it measured. The new group's
store is hosted by the process that spawns its rank 0 (this process, or the job's rank 0), on a
port the kernel picks as it binds, and outlives the ranks. A plan that fails or runs out of memory
is reported (a rank that died by its number) and the others go on.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stratagem.distributed import (
    host_store,
    join_group,
    launched_job,
    leave_spawned_process,
    leaving_process_group,
    naming_lost_peers,
    rank_died,
    ranks_on_this_host,
    share_host_cores,
)
from stratagem.advisor.cost.estimate import Estimate
from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.progress import Progress
from stratagem.units import format_bytes, format_seconds
from stratagem.verify.events import EventRelay, event_writer
from stratagem.verify.runner import Measured, measure_plan
from stratagem.verify.models import real_model

__all__ = ["Verified", "measured_winner", "too_close_to_call", "verify_estimates", "verify_plan"]

LOST_HINT = ("HINT: that rank's output says why it died (or the kernel's log, for the OOM killer); "
             "the other plans go on")
"""What a plan's surviving ranks add when a peer died."""


@dataclass(frozen=True, slots=True)
class Verified:
    """One plan: the advisor's estimate and what the run measured (or why it failed)."""

    estimate: Estimate
    measured: Measured | None
    error: str | None = None

    @property
    def plan(self) -> Plan:
        return self.estimate.plan

    @property
    def time_error(self) -> float | None:
        """(predicted − measured) / measured step time."""
        if self.measured is None:
            return None
        return self.estimate.time.step_seconds / self.measured.step_seconds - 1

    @property
    def memory_error(self) -> float | None:
        """(predicted − measured) / measured peak memory per rank."""
        if self.measured is None or self.measured.peak_bytes == 0:
            return None
        return self.estimate.memory.total / self.measured.peak_bytes - 1


def verify_estimates(model: str, estimates: Sequence[Estimate], *, seq_len: int | None, optimizer: str,
                     grad_clip: str | None = None, steps: int = 3, warmup: int = 1, timeout: float = 300.0,
                     repeats: int = 1,
                     progress: Callable[[int, Verified], None] | None = None,
                     display: Progress | None = None) -> list[Verified]:
    """Run every estimate's plan (``verify_plan``) ``repeats`` times, in rounds that run each plan
    once in turn (a host whose speed drifts moves them all alike), pooling each plan's runs
    (:meth:`Measured.pooled`); a plan that fails is not run again. ``progress(index, result)``
    after each run, with the plan's runs so far; ``display`` shows each plan's prediction, spawn,
    build and steps as they come. A model the spawned ranks cannot load is a :class:`UsageError`."""
    runs: list[list[Measured]] = [[] for _ in estimates]
    errors: list[str | None] = [None for _ in estimates]
    for _ in range(repeats):
        for index, estimate in enumerate(estimates):
            if errors[index] is not None:
                continue
            if display is not None:
                display.note("plan", f"{index + 1}/{len(estimates)} {estimate.plan.name}: predicted "
                             f"{format_seconds(estimate.time.step_seconds)} a step, "
                             f"{format_bytes(estimate.memory.total)} a rank")
            try:
                runs[index].append(verify_plan(model, estimate.plan, seq_len=seq_len, optimizer=optimizer,
                                               grad_clip=grad_clip, steps=steps, warmup=warmup, timeout=timeout,
                                               display=display))
            except RuntimeError as err:
                errors[index] = str(err)
            if progress is not None:
                progress(index, _verified(estimate, runs[index], errors[index]))
    return [_verified(estimate, mine, error) for estimate, mine, error in zip(estimates, runs, errors)]


def _verified(estimate: Estimate, runs: list[Measured], error: str | None) -> Verified:
    if error is not None or not runs:
        return Verified(estimate, None, error)
    return Verified(estimate, runs[0] if len(runs) == 1 else Measured.pooled(runs))


def measured_winner(results: Sequence[Verified]) -> Verified | None:
    """The plan whose median step was fastest (None when none ran)."""
    ran = [r for r in results if r.measured is not None]
    return min(ran, key=lambda r: r.measured.step_seconds) if ran else None


def too_close_to_call(results: Sequence[Verified], winner: Verified) -> list[Verified]:
    """The plans other than ``winner`` whose measured steps' range overlaps the winner's: at the
    noise measured, either may be the faster."""
    return [r for r in results if r is not winner and r.measured is not None
            and r.measured.fastest <= winner.measured.slowest]


def verify_plan(model: str, plan: Plan, *, seq_len: int | None, optimizer: str, grad_clip: str | None = None,
                steps: int = 3, warmup: int = 1, timeout: float = 300.0, display: Progress | None = None) -> Measured:
    """Train ``plan`` on ``model`` (a preset, ``pkg.module:factory`` or ``hf:PATH``, built for real
    in every rank: :mod:`~stratagem.verify.models`) in fresh processes and measure it
    (:func:`~stratagem.verify.runner.measure_plan`, the gradients clipped as ``grad_clip`` says:
    ``Workload.grad_clip``): ``plan.world_size`` spawned on this host, or,
    inside a launched job (:func:`~stratagem.distributed.launched_job`, its process
    group up), one per rank of the job, on that rank's node, joined in a group of their own. Every
    rank of a job must call it. Raises RuntimeError with the error of the rank that failed first
    (the cause: its peers fail after it), or when the run exceeds ``timeout`` seconds; the job's
    own group stays usable for the next plan. A model the spawned ranks cannot load is a
    :class:`UsageError` (on every rank of a job). ``display`` shows what rank 0 does as it happens."""
    real_model(model, seq_len=seq_len)  # a model verify cannot run fails here, before spawning
    run = (model, plan.to_json(), seq_len, optimizer, grad_clip, steps, warmup)
    if not launched_job():
        ranks = list(range(plan.world_size))
        store = host_store()  # referenced until the ranks are done
        try:
            measured = _run_ranks(ranks, ranks, plan.world_size, ("127.0.0.1", store.port), run, timeout,
                                  ranks_on_host=plan.world_size, display=display)
        except _Failure as err:
            if err.usage:
                raise UsageError(str(err)) from None
            raise
        if measured is None:
            raise RuntimeError("rank 0 wrote no measurement")
        return measured
    import torch.distributed as dist

    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"{plan.name} needs {plan.world_size} ranks; the job has {dist.get_world_size()}")
    store = host_store() if dist.get_rank() == 0 else None  # the new group's store: in rank 0, until the end
    rendezvous = [(socket.gethostname(), store.port) if store is not None else None]
    dist.broadcast_object_list(rendezvous, src=0)
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    sharing = ranks_on_this_host()  # not LOCAL_WORLD_SIZE: a launcher's nodes may share one host
    try:
        measured = _run_ranks([rank], [local_rank], plan.world_size, rendezvous[0], run, timeout,
                              ranks_on_host=sharing, display=display)
        failure = None
    except _Failure as err:
        measured, failure = None, (err.when, str(err), err.usage)
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (measured, failure))
    usage = [failure[1] for _, failure in outcomes if failure is not None and failure[2]]
    if usage:  # every rank raises it, so the job's ranks stay together
        raise UsageError(usage[0])
    if outcomes[0][0] is None:
        failures = [failure[:2] for _, failure in outcomes if failure is not None]
        # The first failure is the cause: the ranks whose peer died fail after it.
        raise RuntimeError(min(failures)[1] if failures else "rank 0 wrote no measurement")
    return outcomes[0][0]


class _Failure(RuntimeError):
    """A rank's process failed or ran out of time, at ``when`` (seconds since the epoch, by its
    node's clock: nodes whose clocks disagree by more than the time a peer takes to notice a
    death may name a peer's lost connection instead of the cause); ``usage``: it could not load
    the model, which no other plan can either."""

    def __init__(self, message: str, when: float, *, usage: bool = False) -> None:
        super().__init__(message)
        self.when = when
        self.usage = usage


def _run_ranks(ranks: list[int], local_ranks: list[int], world_size: int, rendezvous: tuple[str, int],
               run: tuple, timeout: float, *, ranks_on_host: int, display: Progress | None = None) -> Measured | None:
    """Spawn one process per rank of ``ranks`` (global ranks of a ``world_size`` group meeting at
    ``rendezvous``: host, port; ``ranks_on_host`` of the group share this host's cores), running
    ``run``; what global rank 0 measured, when it is among them (its events shown on ``display``
    as they come). Raises :class:`_Failure` with the first failure of those processes (``usage``
    when a rank could not load the model), or when they run past ``timeout`` seconds."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        relay = EventRelay(out, display, ranks=world_size) if display is not None and 0 in ranks else None
        args = (ranks, local_ranks, world_size, ranks_on_host, rendezvous, *run, timeout, out)
        context = mp.start_processes(_worker, args=args, nprocs=len(ranks), join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=_POLL_SECONDS):
                if relay is not None:
                    relay.poll()
                if time.monotonic() > deadline:
                    raise _Failure(f"timed out after {timeout:.0f} s", time.time())
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            usage = _first_error(out, "usage-error-*.json")
            when, message = usage or _first_error(out) or (time.time(), rank_died(err, ranks, world_size))
            raise _Failure(message, when, usage=usage is not None) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            if relay is not None:
                relay.finish(ok=context.processes[0].exitcode == 0)
        result = out / "measured.json"
        return Measured.from_dict(json.loads(result.read_text())) if result.exists() else None


_POLL_SECONDS = 0.25
"""How often the spawning process looks at its ranks (and shows rank 0's events)."""

_LOAD_HINT = ("HINT: each plan runs in fresh processes that import the model by name: a factory's module must be "
              "importable there (a file on PYTHONPATH or in the working directory), not only in this process")


def _worker(index: int, ranks: list[int], local_ranks: list[int], world_size: int, ranks_on_host: int,
            rendezvous: tuple[str, int], model: str, plan_json: str, seq_len: int | None, optimizer: str,
            grad_clip: str | None, steps: int, warmup: int, timeout: float, out: Path) -> None:
    rank, local_rank = ranks[index], local_ranks[index]
    try:  # first: a model this process cannot load fails every plan alike, a usage error
        source = real_model(model, seq_len=seq_len)
    except UsageError as err:
        message = f"a spawned rank could not load the model: {str(err).splitlines()[0]}\n{_LOAD_HINT}"
        (out / f"usage-error-{rank}.json").write_text(json.dumps({"when": time.time(), "message": message}))
        raise
    os.environ.update(MASTER_ADDR=rendezvous[0], MASTER_PORT=str(rendezvous[1]), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        share_host_cores(ranks_on_host)
    # A rank whose peer hangs gives up after ``timeout`` instead of waiting in a collective for good.
    join_group("nccl" if cuda else "gloo", rendezvous, rank=rank, world_size=world_size,
               timeout=datetime.timedelta(seconds=timeout))
    report = event_writer(out) if rank == 0 else None  # the other ranks stay quiet
    with leaving_process_group():
        if report is not None:
            report("joined")
        try:
            with naming_lost_peers(LOST_HINT):
                measured = measure_plan(source, Plan.from_json(plan_json), optimizer=optimizer, grad_clip=grad_clip,
                                        steps=steps, warmup=warmup, on_event=report)
        except BaseException as err:
            oom = isinstance(err, torch.OutOfMemoryError)
            failure = {"when": time.time(), "message": "out of memory" if oom else _summary(err)}
            (out / f"error-{rank}.json").write_text(json.dumps(failure))
            raise
        if rank == 0:
            (out / "measured.json").write_text(json.dumps(measured.to_dict()))
    leave_spawned_process()


def _summary(err: BaseException) -> str:
    last = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    where = f" (at {Path(last[0].filename).name}:{last[0].lineno})" if last else ""
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}{where}"


def _first_error(out: Path, pattern: str = "error-*.json") -> tuple[float, str] | None:
    """(when, message) of the rank that failed first: the cause, where its peers then lost it."""
    failures = [json.loads(path.read_text()) for path in out.glob(pattern)]
    return min(((f["when"], f["message"]) for f in failures), default=None)
