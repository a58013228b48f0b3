"""Profiles by name: measured once on fake tensors, then read back from an on-disk cache.

Profiling needs torch and its fake-tensor machinery (several seconds of imports here); the
cost models need neither. ``profile_spec`` keys a profile by everything it depends on — the
model (a preset name, or a Hugging Face config's contents), batch size, sequence length,
precision, the torch (and transformers) version and the source of stratagem's profiler and
presets — so a cached profile is exactly the one a new measurement would give. Factories
(``pkg.module:factory``) run user code whose dependencies we cannot see: never cached.

The cache lives in ``$STRATAGEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/stratagem``, else
``~/.cache/stratagem``. A cached profile is checked on read (``ModelProfile.from_dict``: its
schema version, types and invariants); one that fails is measured again, and a cache that cannot
be written costs only the next run a measurement. Either way the profile's notes and a
:class:`ProfileCacheWarning` say which file and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.advisor.profile.model_profile import ModelProfile, ProfileDataError
from stratagem.plan.precision import get_precision

if TYPE_CHECKING:
    from stratagem.advisor.profile.sources import ModelSource

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
"""Samples the advisor profiles a model at (its costs scale to any micro-batch from there). At one,
ViT-B/16 had counted 31 % fewer bytes per image than at two or four: its activations ``[1, 197,
768]`` had the position embedding's shape, and were taken for its gradient while gradient writes
were told by shape (``measure._gradient_of`` asks autograd now: tests/unit/test_profiles.py holds
one, two and four to 2 % of each other)."""


class ProfileCacheWarning(UserWarning):
    """A cached profile was ignored, or a measured one could not be cached."""


def profile_spec(spec: str, *, batch_size: int = PROFILE_BATCH, seq_len: int | None = None, kernels: str = "gpu",
                 precision: str = "bf16-mixed", cache: bool = True) -> ModelProfile:
    """The profile of the model named by ``spec`` (see :mod:`~stratagem.advisor.profile.sources`)
    for one step of ``batch_size`` samples: from the cache when ``cache`` and it holds one."""
    get_precision(precision)
    key = _cache_key(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, kernels=kernels) if cache else None
    path = cache_dir() / "profiles" / f"{key}.json" if key else None
    problems = []
    if path is not None and (path.exists() or path.is_symlink()):
        profile, why = _read_cached(path)
        if profile is not None:
            return profile
        problems.append(f"ignored the cached profile {path}: {why}; measured it again")
    profile = _measure(spec, batch_size=batch_size, seq_len=seq_len, precision=precision, kernels=kernels)
    if path is not None:
        why = _write_atomically(path, json.dumps(profile.to_dict()))
        if why:
            problems.append(f"could not cache the profile at {path}: {why}")
    for problem in problems:
        warnings.warn(problem, ProfileCacheWarning, stacklevel=2)
    return replace(profile, notes=(*profile.notes, *problems)) if problems else profile


def _read_cached(path: Path) -> tuple[ModelProfile | None, str]:
    """The profile stored at ``path``, or None and why it cannot be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        return None, f"unreadable ({err.strerror or err})"
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except (ValueError, RecursionError) as err:
        return None, f"not JSON ({err})"
    try:
        return ModelProfile.from_dict(data), ""
    except ProfileDataError as err:
        return None, str(err)


def _measure(spec: str, *, batch_size: int, seq_len: int | None, precision: str, kernels: str) -> ModelProfile:
    from stratagem.advisor.profile.sources import load_model
    from stratagem.advisor.profile.profiler import profile_model

    source = load_model(spec, batch_size=batch_size, seq_len=seq_len)
    factory = is_factory(spec)
    # A factory that does not declare batch_size (or seq_len) chose its own: the profile reads
    # them off its inputs. One that does is told them, whatever layout its inputs have.
    profile = profile_model(source.module, source.example_inputs, loss_fn=source.loss_fn, precision=precision,
                            name=source.name, batch_size=source.batch_size if factory else batch_size,
                            seq_len=source.seq_len if factory else None, kernels=kernels)
    own = (f"{spec} declares no batch_size parameter: profiled at the {profile.batch_size} samples its inputs "
           f"hold, not the {batch_size} asked for",) if factory and profile.batch_size != batch_size else ()
    if not factory:  # a preset's loss, or a Hugging Face model's own: verify runs either on the vocabulary shards
        profile = profile.with_head_style("vocab_loss")
    return replace(profile, notes=(*source.notes, *own, *profile.notes),
                   pp_unavailable=profile.pp_unavailable or (_pipeline_refusal(source) if factory else None))


def is_factory(spec: str) -> bool:
    """Whether ``spec`` names a factory, ``pkg.module:factory`` (not a preset or an ``hf:`` config)."""
    return not spec.startswith("hf:") and ":" in spec


def _pipeline_refusal(source: ModelSource) -> str | None:
    """Why a factory's model cannot run as a pipeline, or None: a pipeline splits the batch into
    micro-batches and its stages take positional inputs."""
    if isinstance(source.example_inputs, Mapping):
        return "its inputs are keyword arguments, and pipeline stages take positional ones"
    inputs = source.example_inputs if isinstance(source.example_inputs, tuple) else (source.example_inputs,)
    first = next((x for x in inputs if getattr(x, "dim", lambda: 0)() > 0), None)  # a tensor with a batch
    if source.batch_size is not None and first is not None and first.shape[0] != source.batch_size:
        return (f"its first input's dimension 0 ({first.shape[0]}) is not the batch of {source.batch_size} it was "
                "told, and a pipeline splits that dimension into micro-batches")
    if source.loss_fn is not None:
        return ("its factory's loss_fn is a function of the whole batch's output (a loss may hold the batch's "
                "targets), which a pipeline cannot apply to each micro-batch's")
    return None


def _cache_key(spec: str, *, batch_size: int, seq_len: int | None, precision: str, kernels: str) -> str | None:
    if spec.startswith("hf:"):
        config = Path(spec[3:])
        try:
            contents = (config / "config.json" if config.is_dir() else config).read_bytes()
        except (OSError, ValueError):
            return None  # missing or unreadable: let loading say what is wrong
        model = f"hf:{hashlib.sha256(contents).hexdigest()}:{_version('transformers')}"
    elif is_factory(spec):
        return None
    else:
        model = f"preset:{spec}"
    parts = [model, str(batch_size), str(seq_len), precision, kernels, _version("torch"), _sources_digest()]
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


def _write_atomically(path: Path, text: str) -> str | None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, replaced into place,
    so readers see the old file or the new, never half of one. Returns why it failed, or None;
    on failure nothing is left behind."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.stem}.",
                                         suffix=".tmp", delete=False) as file:
            tmp = file.name
            os.chmod(tmp, 0o644)  # tempfile makes it private (0600); a profile is not secret
            file.write(text)
        os.replace(tmp, path)
        tmp = None
        return None
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    finally:
        if tmp is not None:  # written but not moved into place (an error, or an interrupt)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
