"""Rendezvous ports and stores, and what ``naming_lost_peers`` lets through, in this process
(the lost ranks themselves are in tests/dist/test_peers.py)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.distributed import free_port, host_store, naming_lost_peers, rank_died
from stratagem.errors import PeerLost


def test_a_free_port_stays_reserved_yet_a_store_can_listen_on_it() -> None:
    port = free_port()
    handed = set()
    for _ in range(500):  # the kernel's own choices skip the reserved port
        with socket.socket() as sock:
            sock.bind(("", 0))
            handed.add(sock.getsockname()[1])
    assert port not in handed
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert server.port == port and server.get("key") == b"value"


def test_a_hosted_store_has_the_port_the_kernel_chose() -> None:
    store = host_store()
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
    assert store.port > 0 and client.add("counter", 2) == 2


def test_errors_other_than_a_lost_peer_pass_unchanged() -> None:
    with pytest.raises(RuntimeError, match="^shapes differ$"), naming_lost_peers():
        raise RuntimeError("shapes differ")
    with pytest.raises(ValueError), naming_lost_peers():
        raise ValueError("Connection reset by peer")  # not a RuntimeError: not a collective's


def test_without_a_heartbeat_a_collective_s_error_passes_unchanged() -> None:
    error = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
    with pytest.raises(RuntimeError) as raised, naming_lost_peers():
        raise error
    assert raised.value is error and not isinstance(raised.value, PeerLost)


def test_a_spawned_rank_that_died_is_named_by_its_rank() -> None:
    killed = mp.ProcessExitedException("process 1 terminated with signal SIGKILL", error_index=1, error_pid=7,
                                       exit_code=-9, signal_name="SIGKILL")
    assert rank_died(killed, [4, 5], 8) == "rank 5 of 8 died (killed by SIGKILL); the run cannot continue without it"
    exited = mp.ProcessExitedException("process 0 terminated with exit code 3", error_index=0, error_pid=7,
                                       exit_code=3)
    assert rank_died(exited, [0, 1], 2).startswith("rank 0 of 2 exited with status 3")
