"""profile_spec's on-disk cache: reused when everything a profile depends on matches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stratagem.advisor.profile import cache as profiles
from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.advisor.profile.cache import CACHE_ENV, PROFILE_BATCH, profile_spec


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path / "profiles"


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured although a cached profile exists")


def test_second_call_reads_the_cache(cache, monkeypatch):
    first = profile_spec("gpt2-tiny", batch_size=2, seq_len=32)
    assert len(list(cache.glob("*.json"))) == 1
    monkeypatch.setattr(profiles, "_measure", _no_measuring)
    assert profile_spec("gpt2-tiny", batch_size=2, seq_len=32) == first


def test_what_the_profile_depends_on_is_in_the_key(cache):
    profile_spec("gpt2-tiny", seq_len=32)
    profile_spec("gpt2-tiny", seq_len=64)
    profile_spec("gpt2-tiny", seq_len=32, precision="fp32")
    profile_spec("gpt2-tiny", seq_len=32, batch_size=4)
    assert len(list(cache.glob("*.json"))) == 4


def test_factories_are_never_cached_and_cache_false_measures(cache):
    profile_spec("model_factories:mlp")
    profile_spec("gpt2-tiny", seq_len=32, cache=False)
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_an_unreadable_entry_is_measured_again(cache):
    profile_spec("gpt2-tiny", seq_len=32)
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    assert profile_spec("gpt2-tiny", seq_len=32).num_params > 0
    assert json.loads(entry.read_text())["name"] == "gpt2-tiny"


def test_profiles_round_trip_through_json():
    profile = profile_spec("llama-tiny", seq_len=16, cache=False)
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_advise_from_a_cached_profile_imports_no_torch(cache):
    argv = ["advise", "--model", "gpt2-tiny", "--cluster", "8xA100", "--json"]
    code = ("import sys\nfrom stratagem.cli import main\nrc = main(%r)\n"
            "print('TORCH', 'torch' in sys.modules, rc, file=sys.stderr)" % argv)
    env = {"PATH": "/usr/bin:/bin", CACHE_ENV: str(cache.parent)}
    for expected_torch in (True, False):  # the first run measures, the second reads the cache
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert f"TORCH {expected_torch} 0" in out.stderr


def test_the_bytes_moved_per_sample_do_not_depend_on_the_samples_profiled(cache):
    """At one image a ViT's activations ``[1, tokens, width]`` have its position embedding's shape
    and dtype: they are still no gradient of it, and move bytes with the batch."""
    per_sample = {b: sum(s.fwd_op_bytes + s.bwd_op_bytes for s in profile_spec("vit-tiny", batch_size=b).segments) / b
                  for b in (1, PROFILE_BATCH, 4)}
    assert per_sample[1] == pytest.approx(per_sample[4], rel=0.02)
    assert per_sample[PROFILE_BATCH] == pytest.approx(per_sample[4], rel=0.02)
