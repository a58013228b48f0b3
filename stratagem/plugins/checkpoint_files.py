"""The files of a sharded checkpoint: written beside the one they replace, marked complete last,
swapped in by renames, and read back only when complete.

A complete checkpoint directory ``<name>`` holds DCP's ``.metadata`` and ``__<rank>_<n>.distcp``
shards, rank 0's :data:`META_FILE`, and :data:`MANIFEST_FILE`, written last: the name and size of
every other file. A save writes into a fresh sibling ``<name>.partial-<id>``; once every rank has
written, rank 0 marks it complete and swaps it in (:func:`swap_in`): ``<name>`` → ``<name>.old``,
``<name>.partial-<id>`` → ``<name>``, then removes ``<name>.old`` and the partial directories of
earlier saves that died. At every step ``<name>`` is complete, or it is missing and ``<name>.old``
is complete, which :func:`resolve` then gives to load.

Functions here touch files only; rank 0 calls them and tells the other ranks (``state_dict.py``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from pathlib import Path

from stratagem.errors import UsageError
from stratagem.units import format_list

__all__ = ["MANIFEST_FILE", "META_FILE", "mark_complete", "missing_parts", "new_partial_dir", "resolve", "swap_in"]

META_FILE = "meta.pt"
"""The non-tensor part of a sharded checkpoint, written by rank 0 (Lightning's name for it)."""
MANIFEST_FILE = "COMPLETE.json"
"""Written last into a checkpoint directory: ``{"files": {name: size}}`` of every other file in it."""
DCP_METADATA = ".metadata"
"""DCP's index of the shards (torch.distributed.checkpoint.filesystem), written by its coordinator."""
OLD_SUFFIX = ".old"
PARTIAL_INFIX = ".partial-"


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _is_checkpoint_file(name: str) -> bool:
    """A file a save writes into its directory (DCP writes ``.metadata.tmp``, then renames it)."""
    return (name in (META_FILE, MANIFEST_FILE, f"{MANIFEST_FILE}.tmp") or name.startswith(DCP_METADATA)
            or name.endswith(".distcp"))


def new_partial_dir(path: Path) -> Path:
    """A new, empty sibling directory of ``path`` for the next checkpoint at ``path`` to be written
    into. Refuses a ``path`` that a save must not replace: a file, or a directory (or a
    ``<path>.old`` beside it) holding files that are no checkpoint's: a save removes them."""
    if path.is_file():
        raise UsageError(f"cannot save a sharded checkpoint to {path}: it is a file\n"
                         "HINT: give a directory path, or save full checkpoints")
    for directory in (path, _sibling(path, OLD_SUFFIX)):
        foreign = sorted(entry.name for entry in directory.iterdir()
                         if not (entry.is_file() and _is_checkpoint_file(entry.name))) if directory.is_dir() else []
        if foreign:
            shown = format_list(foreign, first=3)
            where = "the directory" if directory == path else f"{directory} (where a save keeps the one it replaces)"
            raise UsageError(f"cannot save a sharded checkpoint to {path}: {where} holds {shown}, which no "
                             "checkpoint writes, and a save removes that directory\n"
                             "HINT: give a new directory path, or move those files elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _sibling(path, PARTIAL_INFIX + uuid.uuid4().hex[:12])
    partial.mkdir()  # not mkdtemp: its 0700 mode would make the checkpoint unreadable to the group
    return partial


def mark_complete(directory: Path) -> None:
    """Write ``directory``'s :data:`MANIFEST_FILE`, listing every file in it with its size, once
    they are on disk. A save calls it last; call it yourself only on a checkpoint you know was
    written whole (one saved before checkpoints were marked complete)."""
    files = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.name != MANIFEST_FILE:
            _sync(entry)
            files[entry.name] = entry.stat().st_size
    temporary = directory / f"{MANIFEST_FILE}.tmp"
    with temporary.open("w") as stream:
        json.dump({"files": files}, stream, indent=1)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, directory / MANIFEST_FILE)  # atomic: the manifest is whole or absent
    _sync(directory)


def missing_parts(directory: Path) -> list[str]:
    """What keeps ``directory`` from being a complete checkpoint: its manifest missing, or files the
    manifest lists missing or of another size. Empty when it is complete."""
    try:
        files = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return [f"{MANIFEST_FILE} missing (written last, once every rank has written its files)"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{MANIFEST_FILE} unreadable"]
    missing = []
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except FileNotFoundError:
            missing.append(f"{name} missing")
            continue
        if found != size:
            missing.append(f"{name} holds {found} of {size} bytes")
    return missing


def swap_in(partial: Path, path: Path) -> None:
    """Make the complete checkpoint ``partial`` the one at ``path``, keeping a complete checkpoint at
    ``path`` (or, between the two renames, at ``<path>.old``) throughout; then remove the old one
    and what earlier saves that died left beside it."""
    old = _sibling(path, OLD_SUFFIX)
    if path.exists() and old.exists():  # an earlier swap died: keep the complete one of the two
        _remove(path if missing_parts(path) else old)
    if path.exists():
        os.rename(path, old)
    os.rename(partial, path)
    _sync(path.parent)
    _remove(old)
    for leftover in path.parent.glob(glob.escape(path.name + PARTIAL_INFIX) + "*"):
        _remove(leftover)


def _remove(directory: Path) -> None:
    """Remove a checkpoint directory, its manifest first: half removed, it reads as incomplete."""
    if not directory.is_dir():
        return
    (directory / MANIFEST_FILE).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def _sync(path: Path) -> None:
    """Flush a file's or directory's contents (a directory's: its entries) to disk, where the
    platform can."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def resolve(path: Path) -> Path:
    """The checkpoint to load for ``path``: ``path`` itself when it is a file or a complete
    checkpoint directory; ``<path>.old`` when a save that died between its two renames left
    ``path`` missing and ``<path>.old`` complete (the caller says so). Otherwise a UsageError says
    that there is no checkpoint at ``path``, or that it is incomplete and what it misses."""
    if path.is_file():
        return path
    old = _sibling(path, OLD_SUFFIX)
    old_complete = old.is_dir() and not missing_parts(old)
    if path.is_dir() and any(_is_checkpoint_file(entry.name) for entry in path.iterdir()):
        missing = missing_parts(path)
        if missing:
            raise _incomplete(path, missing, old if old_complete else None)
        return path
    if not path.exists() and old_complete:
        return old
    partials = sorted(p.name for p in path.parent.glob(glob.escape(path.name + PARTIAL_INFIX) + "*") if p.is_dir())
    if partials:  # the first save to path died before its checkpoint was complete
        raise UsageError(f"no checkpoint at {path}: a save to it did not finish, leaving only {', '.join(partials)} "
                         "beside it, incomplete\nHINT: resume from an earlier checkpoint, or save again (the next "
                         "save removes what is left)")
    raise UsageError(f"no checkpoint at {path}\nHINT: give a checkpoint file, or a directory holding {META_FILE}")


def _incomplete(path: Path, missing: list[str], complete_old: Path | None) -> UsageError:
    if complete_old is not None:
        hint = f"the previous checkpoint, {complete_old}, is complete: resume from it"
    elif (path / META_FILE).is_file() and (path / DCP_METADATA).is_file() and not (path / MANIFEST_FILE).exists():
        hint = (f"a checkpoint saved whole before checkpoints were marked complete lacks {MANIFEST_FILE}: if this "
                "is one, stratagem.plugins.state_dict.mark_complete(path) marks it; else resume from an earlier one")
    else:
        hint = "resume from an earlier checkpoint, or save this one again"
    return UsageError(f"the checkpoint at {path} is incomplete (its save did not finish): "
                      f"{', '.join(missing)}\nHINT: {hint}")
