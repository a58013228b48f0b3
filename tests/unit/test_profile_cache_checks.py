"""Cached profiles are checked on read: a schema version, every field's type and the invariants
the cost models rely on. What fails is measured again with a note saying which file and why; a
cache that cannot be written leaves nothing behind and does not fail the command."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import fields

import pytest

from stratagem.advisor.profile import cache as profiles
from stratagem.advisor.profile.cache import CACHE_ENV, ProfileCacheWarning, profile_spec
from stratagem.advisor.profile.model_profile import (SCHEMA_VERSION, AttentionCall, BatchNormCall, ConvLayer,
                                                     LinearLayer, ModelProfile, ProfileDataError, SegmentProfile)

SPEC, SEQ = "gpt2-tiny", 32


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    """gpt2-tiny's profile, measured once (the session's cache)."""
    return profile_spec(SPEC, seq_len=SEQ, precision="fp32")


@pytest.fixture
def cache(tmp_path, monkeypatch, measured):
    """An empty cache folder; measuring returns ``measured`` at once and is counted."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls = []

    def measure(spec, **kwargs):
        calls.append(spec)
        return measured

    monkeypatch.setattr(profiles, "_measure", measure)
    key = profiles._cache_key(SPEC, batch_size=profiles.PROFILE_BATCH, seq_len=SEQ, precision="fp32", kernels="gpu")
    return tmp_path / "profiles", tmp_path / "profiles" / f"{key}.json", calls


def _profile() -> ModelProfile:
    return profile_spec(SPEC, seq_len=SEQ, precision="fp32")


def _leftovers(folder) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.endswith(".tmp")] if folder.exists() else []


def test_cached_profiles_carry_the_schema_version(cache, measured):
    folder, entry, calls = cache
    _profile()
    assert json.loads(entry.read_text())["schema_version"] == SCHEMA_VERSION
    assert _profile() == measured and calls == [SPEC]  # the second call read it back


def test_the_profiles_fields_are_pinned_to_the_schema_version():
    """Changing a field of the profile changes what a stored one means: bump SCHEMA_VERSION (and
    this pin) with it, so older cached profiles are measured again rather than misread."""
    layout = [[c.__name__, [[f.name, str(f.type)] for f in fields(c)]]
              for c in (ModelProfile, SegmentProfile, LinearLayer, ConvLayer, BatchNormCall, AttentionCall)]
    digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]
    assert (SCHEMA_VERSION, digest) == (29, "87b83b8c72c596ef"), "profile fields changed: bump SCHEMA_VERSION"


def _set(path: str, value):
    def mutate(data):
        *keys, last = path.split(".")
        target = data
        for key in keys:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return mutate


MUTATIONS = {
    "schema_version": (_set("schema_version", 0), "schema_version is 0"),
    "no_schema_version": (_set("schema_version", KeyError), "schema_version is None"),
    "blocks_empty": (_set("blocks", []), "blocks: empty although block_container"),
    "negative_count": (_set("blocks.0.fwd_flops", -1), "blocks[0].fwd_flops: must be at least 0"),
    "count_as_string": (_set("embed.num_params", "12"), "embed.num_params: expected an integer"),
    "count_as_bool": (_set("head.saved_bytes", True), "head.saved_bytes: expected an integer"),
    "count_as_float": (_set("head.param_bytes", 1.5), "head.param_bytes: expected an integer"),
    "missing_segment_field": (_set("blocks.1.output_bytes", KeyError), "blocks[1].output_bytes: missing"),
    "missing_embed": (_set("embed", KeyError), "profile.embed: missing"),
    "segment_not_object": (_set("head", [1]), "head: expected a JSON object"),
    "blocks_not_list": (_set("blocks", {}), "blocks: expected a list"),
    "batch_size_zero": (_set("batch_size", 0), "profile.batch_size: must be at least 1"),
    "unknown_precision": (_set("precision", "fp8"), "precision: 'fp8' is none of"),
    "measured_as_unknown": (_set("blocks.1.measured_as", "nowhere"), "blocks[1].measured_as: 'nowhere'"),
    "linear_in_features": (_set("blocks.0.linears.0.in_features", 0), "in_features: must be at least 1"),
    "tp_layout_pair": (_set("tp_layout", [["a"]]), "tp_layout[0]: expected [module pattern, style]"),
    "totals_disagree": (_set("parameters", 1), "parameters: 1 disagrees with the segments' sum"),
    "flops_disagree": (_set("embed.flops", -5), "embed.flops: -5 is not fwd_flops + bwd_flops"),
    "seconds_nan": (_set("profile_seconds", float("nan")), "profile_seconds: expected a non-negative number"),
    "notes_not_text": (_set("notes", [3]), "notes[0]: expected a string"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_from_dict_checks_types_and_invariants(measured, name):
    mutate, says = MUTATIONS[name]
    data = copy.deepcopy(measured.to_dict())
    assert ModelProfile.from_dict(copy.deepcopy(data)) == measured
    mutate(data)
    with pytest.raises(ProfileDataError) as caught:
        ModelProfile.from_dict(data)
    assert says in str(caught.value), str(caught.value)


@pytest.mark.parametrize("name", ["schema_version", "blocks_empty", "negative_count", "missing_segment_field"])
def test_a_cached_profile_with_wrong_content_is_measured_again_with_a_note(cache, measured, name):
    folder, entry, calls = cache
    _profile()
    data = json.loads(entry.read_text())
    mutate, says = MUTATIONS[name]
    mutate(data)
    entry.write_text(json.dumps(data))
    with pytest.warns(ProfileCacheWarning, match="ignored the cached profile") as caught:
        profile = _profile()
    assert calls == [SPEC, SPEC]
    (note,) = [n for n in profile.notes if n.startswith("ignored")]
    assert str(entry) in note and says in note and str(caught[0].message) == note
    assert ModelProfile.from_dict(json.loads(entry.read_text())) == measured  # rewritten, without the note
    assert _profile() == measured and len(calls) == 2


@pytest.mark.parametrize("garbage, says", [
    (b"{not json", "not JSON"), (b"\xff\xfe\x00", "not UTF-8"), (b"null", "a profile is a JSON object"),
    (b"[]", "a profile is a JSON object"), (b"[" * 100_000, "not JSON"),
])
def test_garbage_in_the_cache_is_measured_again_with_a_note(cache, measured, garbage, says):
    folder, entry, calls = cache
    folder.mkdir(parents=True)
    entry.write_bytes(garbage)
    with pytest.warns(ProfileCacheWarning, match=says):
        profile = _profile()
    assert calls == [SPEC] and any(str(entry) in n and says in n for n in profile.notes)
    assert ModelProfile.from_dict(json.loads(entry.read_text())) == measured


def test_a_directory_in_the_files_place_leaves_nothing_behind(cache, measured):
    folder, entry, calls = cache
    entry.mkdir(parents=True)
    with pytest.warns(ProfileCacheWarning):
        profile = _profile()
    assert profile.num_params == measured.num_params and calls == [SPEC]
    assert any("could not cache the profile" in n and str(entry) in n for n in profile.notes)
    assert entry.is_dir() and not list(entry.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [entry.name] and not _leftovers(folder)


def test_a_cache_folder_that_is_a_file_does_not_fail_the_command(cache, measured):
    folder, entry, calls = cache
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("not a folder")
    with pytest.warns(ProfileCacheWarning, match="could not cache the profile"):
        profile = _profile()
    assert profile.num_params == measured.num_params and folder.read_text() == "not a folder"


def test_a_read_only_cache_folder_leaves_nothing_behind(cache, measured):
    folder, entry, calls = cache
    folder.mkdir(parents=True)
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who writes into read-only folders (root)")
        with pytest.warns(ProfileCacheWarning, match="could not cache the profile"):
            profile = _profile()
        assert profile.num_params == measured.num_params and not list(folder.iterdir())
    finally:
        folder.chmod(0o755)


def test_a_failed_replace_removes_the_temporary_file(cache, monkeypatch, measured):
    folder, entry, calls = cache

    def replace(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(profiles.os, "replace", replace)
    with pytest.warns(ProfileCacheWarning, match="PermissionError: Permission denied"):
        profile = _profile()
    assert profile.num_params == measured.num_params
    assert not entry.exists() and not list(folder.iterdir())


def test_an_interrupted_write_removes_the_temporary_file(cache, monkeypatch):
    folder, entry, calls = cache

    def replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiles.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _profile()
    assert not list(folder.iterdir())


def test_the_cache_key_follows_every_profiler_source():
    """Every module of advisor/profile (this test's subject included) is in the key's digest."""
    digested = {p for pattern in profiles.PROFILER_SOURCES for p in profiles._PACKAGE.glob(pattern)}
    assert set((profiles._PACKAGE / "advisor" / "profile").glob("*.py")) <= digested
    assert {"sources.py", "cache.py", "model_profile.py"} <= {p.name for p in digested}
