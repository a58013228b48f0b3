"""Shared test set-up: profiles are cached in one temporary folder per test session, never in
the user's cache (the first test to profile a preset pays for it; later ones read it back)."""

from __future__ import annotations

import pytest

from stratagem.advisor.profiles import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profile-cache")))
    yield
    mp.undo()
