"""Shared test set-up: profiles are cached in one temporary folder per test session, never in
the user's cache (the first test to profile a preset pays for it; later ones read it back); a
one-rank gloo group in the test process for the tests that need one."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from stratagem.advisor.profile.cache import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profile-cache")))
    yield
    mp.undo()


@pytest.fixture
def one_rank():
    """A default process group of this process alone (gloo), unless one is up already: a
    Lightning Trainer run in this process keeps its group after ``fit``, as Lightning does."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
