"""Profiles by name: measured once on fake tensors, then read back from an on-disk cache.

Profiling needs torch and its fake-tensor machinery (several seconds of imports here); the
cost models need neither. ``profile_spec`` keys a profile by everything it depends on — the
model (a preset name, or a Hugging Face config's contents), batch size, sequence length,
precision, the torch (and transformers) version and the source of stratagem's profiler and
presets — so a cached profile is exactly the one a new measurement would give. Factories
(``pkg.module:factory``) run user code whose dependencies we cannot see: never cached.

The cache lives in ``$STRATAGEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/stratagem``, else
``~/.cache/stratagem``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from stratagem.advisor.profile.model_profile import ModelProfile
from stratagem.plan.precision import get_precision

CACHE_ENV = "STRATAGEM_CACHE_DIR"
_PACKAGE = Path(__file__).resolve().parents[2]
# The code a profile's numbers depend on: when it changes, cached profiles no longer apply.
PROFILER_SOURCES = ("advisor/profile/*.py", "models/*.py", "plan/*.py", "errors.py")


def cache_dir() -> Path:
    """Where profiles are cached."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stratagem"


PROFILE_BATCH = 2
"""Samples the advisor profiles a model at (its costs scale to any micro-batch from there): two,
not one, since at one sample a batch dimension of size 1 lets reshapes of transposed tensors be
views, and the copies every larger batch makes go uncounted (ViT-B/16 at one image counted 31 %
fewer bytes moved per image than at two or four)."""


def profile_spec(spec: str, *, batch_size: int = PROFILE_BATCH, seq_len: int | None = None,
                 precision: str = "bf16-mixed", cache: bool = True) -> ModelProfile:
    """The profile of the model named by ``spec`` (see :mod:`~stratagem.advisor.profile.sources`)
    for one step of ``batch_size`` samples: from the cache when ``cache`` and it holds one."""
    get_precision(precision)
    key = _cache_key(spec, batch_size=batch_size, seq_len=seq_len, precision=precision) if cache else None
    path = cache_dir() / "profiles" / f"{key}.json" if key else None
    if path is not None and path.is_file():
        try:
            return ModelProfile.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # unreadable (an interrupted write, another version's layout): measure again
    profile = _measure(spec, batch_size=batch_size, seq_len=seq_len, precision=precision)
    if path is not None:
        _write_atomically(path, json.dumps(profile.to_dict()))
    return profile


def _measure(spec: str, *, batch_size: int, seq_len: int | None, precision: str) -> ModelProfile:
    from stratagem.advisor.profile.sources import load_model
    from stratagem.advisor.profile.profiler import profile_model

    source = load_model(spec, batch_size=batch_size, seq_len=seq_len)
    profile = profile_model(source.module, source.example_inputs, loss_fn=source.loss_fn,
                            precision=precision, name=source.name, batch_size=batch_size)
    return replace(profile, notes=(*source.notes, *profile.notes))


def _cache_key(spec: str, *, batch_size: int, seq_len: int | None, precision: str) -> str | None:
    if spec.startswith("hf:"):
        config = Path(spec[3:])
        config = config / "config.json" if config.is_dir() else config
        if not config.is_file():
            return None  # let loading say what is wrong
        model = f"hf:{hashlib.sha256(config.read_bytes()).hexdigest()}:{_version('transformers')}"
    elif ":" in spec:
        return None
    else:
        model = f"preset:{spec}"
    parts = [model, str(batch_size), str(seq_len), precision, _version("torch"), _sources_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "none"


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for pattern in PROFILER_SOURCES:
        for path in sorted(_PACKAGE.glob(pattern)):
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        pass  # a read-only or full cache only costs the next run a measurement
