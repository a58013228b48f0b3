"""Process groups as this package starts and ends them (calibrate, verify and the Lightning and
Fabric strategies share these), the ports and stores they meet on, reductions over their ranks,
and naming a rank that stopped answering.

Lost ranks: every rank of a group this package starts keeps a heartbeat in the group's store (a
counter a daemon thread adds to once a second, :func:`start_heartbeat`). When a collective fails
the way a dead peer makes it fail, :func:`naming_lost_peers` watches the counters for a few beats:
the ranks whose counter stood still are named in a :class:`~stratagem.errors.PeerLost`; a store
that no longer answers means its host is gone (rank 0, unless a launcher hosts it).
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from stratagem.errors import PeerLost

__all__ = ["BEAT_SECONDS", "NAMING_SECONDS", "RESUME_HINT", "across_ranks", "free_port", "host_store",
           "import_group_defaults", "init_process_group", "join_group", "launched_job", "leave_process_group",
           "leave_spawned_process", "leaving_process_group", "name_lost_peers_in", "naming_lost_peers",
           "rank_died", "ranks_on_this_host", "share_host_cores", "start_heartbeat", "stop_heartbeat"]

BEAT_SECONDS = 1.0
"""How often a rank's heartbeat ticks in the group's store."""
QUIET_BEATS = 2.5
"""Beats a rank's counter must stand still, once a collective failed, for it to count as lost."""
NAMING_SECONDS = QUIET_BEATS * BEAT_SECONDS
"""How long a rank whose collective failed watches the heartbeats before it names the lost rank."""
RESUME_HINT = ("HINT: start the job again, every rank, and resume from its last checkpoint "
               "(Lightning: trainer.fit(..., ckpt_path=...); Fabric: fabric.load(path, state))")
"""What to do when a rank is lost: the plan is synchronous, so the job starts over from a checkpoint."""
_RESERVED: deque[socket.socket] = deque(maxlen=64)
"""Sockets holding the ports :func:`free_port` handed out (the oldest let go past 64)."""
# What gloo and NCCL raise when a peer died or hangs (the store's own errors are DistError).
_PEER_FAILURES = ("connection reset", "connection closed", "connection refused", "broken pipe", "timed out",
                  "socket closed", "remote process exited", "network error", "communicator was aborted")
_STORE_TIMEOUT = timedelta(seconds=10)
"""How long the heartbeat's connection waits on the store."""
_Class = TypeVar("_Class", bound=type)


def launched_job() -> bool:
    """Whether this process is a rank of a launched job (torchrun, a Slurm step: ``RANK`` and
    ``WORLD_SIZE`` set) rather than a program that spawns its own ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on this host for a rendezvous another program hosts (a launcher's
    ``--master-port``, ``MASTER_PORT`` for a framework's rank 0). The port stays reserved as
    long as this process lives (or until 64 more are handed out): a socket stays bound to it
    with ``SO_REUSEADDR`` and never listens, so the kernel gives it to no other ``bind(0)`` and
    no outgoing connection, while torch's ``TCPStore``, which binds with ``SO_REUSEADDR``, can
    still listen on it. Not proof against a program that binds that very number without asking
    the kernel; groups this package spawns itself meet on :func:`host_store` instead, which is
    race-free."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    if not _RESERVED:
        atexit.register(_release_ports)
    if len(_RESERVED) == _RESERVED.maxlen:
        _RESERVED.popleft().close()
    _RESERVED.append(sock)
    return sock.getsockname()[1]


def _release_ports() -> None:
    while _RESERVED:
        _RESERVED.popleft().close()


def host_store(*, host: str = "127.0.0.1", timeout: timedelta = timedelta(seconds=300)) -> dist.TCPStore:
    """The store of a process group whose ranks this process starts, hosted here (``.port`` is
    where the ranks meet it, with :func:`join_group`). The kernel picks the port as the store binds
    it (port 0), so no other process can take it in between; and the store outlives any of the
    ranks, so a survivor can always name the one lost. Keep it referenced until they are done."""
    return dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)


def join_group(backend: str, address: tuple[str, int], *, rank: int, world_size: int,
               timeout: timedelta | None = None) -> None:
    """Join, as ``rank`` of ``world_size``, the default process group whose store
    :func:`host_store` hosts at ``address`` (host, port); as :func:`init_process_group` otherwise
    (``timeout``: the collectives', torch's default when None)."""
    store = dist.TCPStore(address[0], address[1], None, False, timeout=timeout or timedelta(seconds=300))
    init_process_group(backend, store=store, rank=rank, world_size=world_size, store_outside=True,
                       **({} if timeout is None else {"timeout": timeout}))


def import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before a process group exists: its functions
    bind the default group as default arguments when it is first imported (the first optimizer
    step imports it, through ``torch._dynamo``), and a live group bound there outlives
    ``destroy_process_group``, its gloo threads running into the interpreter's teardown, where
    gloo can abort the process (docs/platform.md)."""
    importlib.import_module("torch.distributed.nn.functional")


def init_process_group(backend: str, *, store_outside: bool | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` after :func:`import_group_defaults`, then this
    rank's heartbeat (:func:`start_heartbeat`, given ``store_outside``)."""
    import_group_defaults()
    dist.init_process_group(backend, **kwargs)
    start_heartbeat(store_outside=store_outside)


def leave_process_group(*, together: bool = True) -> None:
    """Destroy the default process group as docs/platform.md has gloo survive it (``terminate
    called without an active exception`` at exit while something still holds a group): stop the
    heartbeat, collect the garbage that may hold one (wrapped modules in reference cycles), wait
    for every rank (``together``; leave it out when a rank failed and the others may be gone),
    then destroy. What torch itself keeps holding, :func:`leave_spawned_process` steps around."""
    stop_heartbeat()
    gc.collect()
    if together:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
    dist.destroy_process_group()


@contextmanager
def leaving_process_group() -> Iterator[None]:
    """Run the body on the default process group, then :func:`leave_process_group`: with every
    rank when the body returned, alone when it raised (the exception goes on)."""
    try:
        yield
    except BaseException:
        leave_process_group(together=False)
        raise
    leave_process_group()


def leave_spawned_process() -> NoReturn:
    """End a process this package spawned, its results written and its group left, without the
    interpreter's teardown. torch keeps process groups referenced past ``destroy_process_group``
    (a ``DeviceMesh`` that DTensor's caches hold; :func:`import_group_defaults` steps around
    another holder), and gloo can abort the process when it tears them down at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ranks_on_this_host(group: dist.ProcessGroup | None = None) -> int:
    """How many ranks of ``group`` (default: the job) run on this host, by host name: those that
    share its cores, whatever node a launcher counts them in (``torchrun --nnodes 2`` on one
    machine makes two nodes of one rank each, ``LOCAL_WORLD_SIZE`` 1, on one host). A collective."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts.count(socket.gethostname())


def share_host_cores(ranks: int) -> int:
    """Give this CPU process its share of the host's usable cores when ``ranks`` processes share
    them: torch's intra-op threads (OpenMP, MKL), which default to every core. Two ranks each
    with every core's threads make each operator's barrier wait for threads the other rank's
    hold: on 2 cores ``calibrate`` timed 1.1 ms per operator, 20 µs with a share. Returns it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // ranks)
    torch.set_num_threads(threads)
    return threads


def across_ranks(value: float, *, smallest: bool = False) -> float:
    """The largest ``value`` over the ranks of the default group (the slowest step, the fullest
    rank), or the smallest (the slowest rate); the same on every rank. A collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if smallest else dist.ReduceOp.MAX)
    return float(tensor.item())


class _Heartbeat:
    """This rank's counter in the group's store, added to every :data:`BEAT_SECONDS` by a daemon
    thread over a connection of its own (the group's may sit in a blocking wait); read back by
    :meth:`quiet_ranks` when a collective failed. A rank that stops beating on purpose (it leaves
    the group, or saw a collective fail and will exit) first says farewell, so that no peer takes
    it for lost; a killed rank cannot."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, store_host: int | None) -> None:
        self.rank, self.world_size, self.store_host = rank, world_size, store_host
        self.group = dist.group.WORLD  # the default group it beats for
        self._store = store.clone()
        self._store.set_timeout(_STORE_TIMEOUT)  # a diagnosis must not wait out the group's timeout
        self._lock = threading.Lock()  # one connection, shared by the thread and a diagnosis
        self._stop = threading.Event()
        self._store.add(_key("heartbeat", rank), 1)  # the first beat, before any collective can fail
        self._thread = threading.Thread(target=self._run, name="stratagem-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                with self._lock:
                    self._store.add(_key("heartbeat", self.rank), 1)
            except RuntimeError:  # the store is gone (DistError): a diagnosis finds that out for itself
                return

    def stop(self) -> None:
        """Say farewell and end the thread (it finishes its current beat first)."""
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_SECONDS)
        try:
            self._read("farewell", [self.rank], add=1)
        except RuntimeError:  # the store is gone (DistError): nobody is left to read it
            pass

    def _read(self, kind: str, ranks: list[int], add: int = 0) -> dict[int, int]:
        """The ``kind`` counters of ``ranks`` (0 for a rank that never set one), after adding ``add``."""
        keys = [_key(kind, rank) for rank in ranks]
        with self._lock:
            if not add and self._store.check(keys):  # one round trip when every key is there
                return {rank: int(value) for rank, value in zip(ranks, self._store.multi_get(keys))}
            return {rank: self._store.add(key, add) for rank, key in zip(ranks, keys)}

    def quiet_ranks(self) -> list[int] | None:
        """The other ranks whose heartbeat stood still for :data:`NAMING_SECONDS` without a
        farewell (returning early when none did); None when the store does not answer."""
        try:
            self._read("farewell", [self.rank], add=1)  # this rank is alive: the peers need not wait on it
            first = self._read("heartbeat", [r for r in range(self.world_size) if r != self.rank])
            quiet, deadline = list(first), time.monotonic() + NAMING_SECONDS
            while quiet and time.monotonic() < deadline:
                time.sleep(BEAT_SECONDS / 4)
                beats, farewells = self._read("heartbeat", quiet), self._read("farewell", quiet)
                quiet = [rank for rank in quiet if beats[rank] == first[rank] and not farewells[rank]]
        except RuntimeError:  # the store does not answer (DistError)
            return None
        return quiet


_HEARTBEAT: _Heartbeat | None = None


def _key(kind: str, rank: int) -> str:
    return f"stratagem/{kind}/{rank}"


def start_heartbeat(*, store_outside: bool | None = None) -> None:
    """Start this rank's heartbeat in the default group's store (once; nothing on one rank, or
    on a store that cannot be cloned). ``store_outside``: whether a process outside the group
    hosts the store (a launcher's agent, :func:`host_store`'s caller) rather than rank 0; None
    reads it from the environment (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``)."""
    global _HEARTBEAT
    if _HEARTBEAT is not None and _HEARTBEAT.group is dist.group.WORLD:
        return
    stop_heartbeat()  # a group left without leave_process_group: its heartbeat goes with it
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if store_outside is None:
        store_outside = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.distributed_c10d._get_default_store()
    try:
        _HEARTBEAT = _Heartbeat(store, dist.get_rank(), dist.get_world_size(), None if store_outside else 0)
    except (RuntimeError, NotImplementedError):  # a store without clone (HashStore, FileStore)
        _HEARTBEAT = None


def stop_heartbeat() -> None:
    """Stop this rank's heartbeat (before the group is left: its peers no longer need it)."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None


def _lost_message(heartbeat: _Heartbeat, err: BaseException) -> str | None:
    """What a failed collective means, from the heartbeats: who stopped answering; None when
    every other rank still beats (the failure is not a lost peer's)."""
    quiet = heartbeat.quiet_ranks()
    world, me = heartbeat.world_size, heartbeat.rank
    if quiet is None and heartbeat.store_host is None:
        who = "the process hosting the job's store (its launcher) stopped answering"
    elif quiet is None:
        who = f"rank {heartbeat.store_host} of {world} stopped answering (it hosts the job's store, which is gone too)"
    elif quiet:
        who = (f"rank{'s' if len(quiet) > 1 else ''} {', '.join(map(str, quiet))} of {world} stopped answering: "
               f"no heartbeat for {NAMING_SECONDS:.1f} s")
    else:
        return None
    return (f"{who} after a collective of rank {me} failed ({_first_sentence(err)}). The job cannot continue: "
            "a synchronous plan needs every rank in every step, and a running process group cannot take a new one.")


def _first_sentence(err: BaseException) -> str:
    """The gist of a collective's error: gloo's first sentence, without its source location."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0][:200]


def _peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is how a collective or the store fails when a peer is gone."""
    if isinstance(err, PeerLost):
        return False
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err).lower() for text in _PEER_FAILURES)


@contextmanager
def naming_lost_peers(hint: str = RESUME_HINT) -> Iterator[None]:
    """Run the body; when a collective in it fails because a rank of the default group is gone
    (see the module docstring), raise :class:`~stratagem.errors.PeerLost` naming the rank, with
    ``hint``, from the collective's error. Other errors pass unchanged; so do all without a
    heartbeat (:func:`start_heartbeat`)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if _HEARTBEAT is None or not _peer_failure(err):
            raise
        message = _lost_message(_HEARTBEAT, err)
        if message is None:
            raise
        raise PeerLost(f"{message}\n{hint}") from err


def name_lost_peers_in(*methods: str, hint: str = RESUME_HINT) -> Callable[[_Class], _Class]:
    """A class decorator: each of ``methods`` (defined on the class or inherited) runs inside
    :func:`naming_lost_peers`, so a framework's step, backward, optimizer step and collectives
    say which rank was lost. Nested calls name it once."""

    def decorate(cls: _Class) -> _Class:
        for name in methods:
            setattr(cls, name, _named(getattr(cls, name), hint))
        return cls

    return decorate


def rank_died(err: Exception, ranks: list[int], world_size: int) -> str:
    """Which spawned rank ended and how, from ``torch.multiprocessing``'s exception (which counts
    processes; process ``i`` ran ``ranks[i]`` of ``world_size``), and that the run cannot go on."""
    index = getattr(err, "error_index", None)
    who = f"rank {ranks[index]} of {world_size}" if index is not None and index < len(ranks) else "a rank"
    signal_name, code = getattr(err, "signal_name", None), getattr(err, "exit_code", None)
    if signal_name:
        what = f"died (killed by {signal_name})"
    elif code is not None:
        what = f"exited with status {code}"
    else:
        what = f"failed: {(str(err).strip().splitlines() or [type(err).__name__])[-1]}"
    return f"{who} {what}; the run cannot continue without it"


def _named(method: Callable[..., Any], hint: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def named(*args: Any, **kwargs: Any) -> Any:
        with naming_lost_peers(hint):
            return method(*args, **kwargs)

    return named
