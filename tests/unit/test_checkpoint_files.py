"""Sharded checkpoints on one gloo rank: what a loader says of an incomplete directory, what it
loads after a save died between its two renames, and what a save refuses or cleans up. The
multi-process crash (a rank killed mid-shard) is tests/dist/test_checkpoint_crash.py."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from stratagem.errors import UsageError
from stratagem.plugins.state_dict import (
    MANIFEST_FILE,
    META_FILE,
    is_sharded_checkpoint,
    load_checkpoint,
    mark_complete,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)
from stratagem.plugins.checkpoint_files import missing_parts, resolve, swap_in

pytestmark = pytest.mark.usefixtures("one_rank")


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam, one step taken (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    save_sharded_checkpoint(path, {"state_dict": model_state_dict(model, full=False),
                                   "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)],
                                   "step": step}, [optimizer])


def _assert_loads(path: Path, model: nn.Module, step: int) -> None:
    """``path`` loads into a fresh model ``model``'s weights and ``step``."""
    fresh, optimizer = _trained(seed=99)
    assert load_checkpoint(path, fresh, [optimizer])["step"] == step
    for name, weight in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], weight), name
    assert optimizer.state_dict()["state"][0]["step"] == 1


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, nn.Module]:
    """A complete checkpoint of step 1 at ``tmp_path/ckpt``, and the model it holds."""
    model, optimizer = _trained(seed=1)
    _save(tmp_path / "ckpt", model, optimizer, step=1)
    return tmp_path / "ckpt", model


def test_a_save_is_complete_and_overwrites_leaving_nothing_beside(saved: tuple[Path, nn.Module]) -> None:
    path, _ = saved
    assert is_sharded_checkpoint(path)
    assert sorted(p.name for p in path.iterdir()) == sorted([".metadata", "__0_0.distcp", META_FILE, MANIFEST_FILE])
    (path.with_name("ckpt.partial-dead")).mkdir()  # what a save that died left
    (path.with_name("ckpt.partial-dead") / "__0_0.distcp").write_bytes(b"half")
    model, optimizer = _trained(seed=2)
    _save(path, model, optimizer, step=2)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
    _assert_loads(path, model, step=2)


def test_a_truncated_shard_is_reported_incomplete_naming_it(saved: tuple[Path, nn.Module]) -> None:
    path, _ = saved
    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(UsageError, match=rf"the checkpoint at {re.escape(str(path))} is incomplete "
                                         rf".*__0_0\.distcp holds {size // 2} of {size} bytes\nHINT: "):
        load_checkpoint(path, *_fresh())
    assert not is_sharded_checkpoint(path)


def test_a_missing_manifest_is_reported_incomplete_and_can_be_marked(saved: tuple[Path, nn.Module]) -> None:
    path, model = saved
    (path / MANIFEST_FILE).unlink()
    with pytest.raises(UsageError, match=rf"{re.escape(str(path))} is incomplete "
                                         rf".*{MANIFEST_FILE} missing.*\nHINT: .*mark_complete"):
        load_checkpoint(path, *_fresh())
    mark_complete(path)  # a checkpoint known to be whole, saved before checkpoints were marked
    _assert_loads(path, model, step=1)


def test_a_save_dying_between_its_renames_leaves_the_old_checkpoint_loadable(
        saved: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    path, first = saved
    rename = os.rename

    def dies_on_the_second_rename(source: os.PathLike, target: os.PathLike) -> None:
        if Path(source).name.startswith("ckpt.partial-"):  # ckpt → ckpt.old went through; the new one never arrives
            raise OSError("killed")
        rename(source, target)

    monkeypatch.setattr(os, "rename", dies_on_the_second_rename)
    second, optimizer = _trained(seed=2)
    with pytest.raises(OSError, match="killed"):
        _save(path, second, optimizer, step=2)
    monkeypatch.undo()
    assert not path.exists() and is_sharded_checkpoint(path.with_name("ckpt.old"))
    with pytest.warns(UserWarning, match=r"loading the checkpoint it was replacing, .*ckpt\.old"):
        _assert_loads(path, first, step=1)
    _save(path, second, optimizer, step=2)  # the next save completes and clears the remains
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
    _assert_loads(path, second, step=2)


def test_an_incomplete_checkpoint_beside_a_complete_old_one_says_where_that_is(
        saved: tuple[Path, nn.Module]) -> None:
    path, _ = saved
    old = path.with_name("ckpt.old")
    path.rename(old)
    path.mkdir()
    shutil.copy(old / META_FILE, path / META_FILE)
    with pytest.raises(UsageError, match=rf"{re.escape(str(path))} is incomplete .*\n"
                                         rf"HINT: the previous checkpoint, {re.escape(str(old))}, is complete"):
        load_checkpoint(path, *_fresh())


def test_no_checkpoint_at_a_directory_of_other_files_nor_at_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(UsageError, match=rf"no checkpoint at {re.escape(str(path))}\nHINT: "):
            load_checkpoint(path, *_fresh())


def test_the_remains_of_a_first_save_that_died_are_named_not_loaded(tmp_path: Path) -> None:
    (tmp_path / "ckpt.partial-dead").mkdir()
    (tmp_path / "ckpt.partial-dead" / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(UsageError, match=r"no checkpoint at .*ckpt: a save to it did not finish, leaving only "
                                         r"ckpt\.partial-dead beside it, incomplete\nHINT: "):
        load_checkpoint(tmp_path / "ckpt", *_fresh())


def test_a_save_refuses_a_file_and_a_directory_of_other_files(tmp_path: Path) -> None:
    model, optimizer = _trained(seed=1)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "ckpt.old").mkdir()  # a save's fallback name, but the user's folder
    (tmp_path / "ckpt.old" / "plot.png").write_text("mine")
    with pytest.raises(UsageError, match=r"the directory holds ckpt\.old, notes\.txt, which no checkpoint "
                                         r"writes.*\nHINT: "):
        _save(tmp_path, model, optimizer, step=1)
    with pytest.raises(UsageError, match=r"ckpt\.old \(where a save keeps the one it replaces\) holds plot\.png, "):
        _save(tmp_path / "ckpt", model, optimizer, step=1)
    with pytest.raises(UsageError, match=r"it is a file\nHINT: "):
        _save(tmp_path / "notes.txt", model, optimizer, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.old", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "ckpt.old" / "plot.png").read_text() == "mine"


def _fresh() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    model, optimizer = _trained(seed=99)
    return model, [optimizer]


class _Killed(BaseException):
    """The process dying at a chosen step (not an Exception: nothing may catch it)."""


def _fake_checkpoint(directory: Path, version: str) -> Path:
    directory.mkdir()
    (directory / META_FILE).write_text(version)
    (directory / "__0_0.distcp").write_bytes(b"x" * 100)
    mark_complete(directory)
    return directory


@pytest.mark.parametrize("before", ["overwrite", "stale-old", "incomplete-beside-old"])
def test_a_swap_dying_at_any_step_leaves_a_complete_checkpoint_to_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str) -> None:
    """Die at each file operation of the swap in turn (a removal dies halfway through): the path
    still resolves to a complete checkpoint (or its error names one), the one it held (``old``,
    or ``older`` beside an incomplete one) or the new one. ``before``: what the swap starts from: a checkpoint; one and
    the half-removed ``.old`` a died swap left; an incomplete one beside a complete ``.old``."""
    path = tmp_path / "ckpt"
    good = "older" if before == "incomplete-beside-old" else "old"
    steps, rename, rmtree = 0, os.rename, shutil.rmtree
    for dies_at in range(20):
        for leftover in tmp_path.iterdir():
            rmtree(leftover)
        _fake_checkpoint(path, "old")
        if before != "overwrite":
            _fake_checkpoint(path.with_name("ckpt.old"), "older")
        if before == "stale-old":
            (path.with_name("ckpt.old") / MANIFEST_FILE).unlink()
        if before == "incomplete-beside-old":
            os.truncate(path / "__0_0.distcp", 10)
        partial = _fake_checkpoint(path.with_name("ckpt.partial-new"), "new")
        steps = 0

        def step() -> None:
            nonlocal steps
            steps += 1
            if steps > dies_at:
                raise _Killed

        def dying_rename(source: os.PathLike, target: os.PathLike) -> None:
            step()
            rename(source, target)

        def dying_rmtree(directory: Path, **options: object) -> None:
            next(p for p in sorted(Path(directory).iterdir())).unlink()  # half removed
            step()
            rmtree(directory, **options)

        monkeypatch.setattr(os, "rename", dying_rename)
        monkeypatch.setattr(shutil, "rmtree", dying_rmtree)
        try:
            swap_in(partial, path)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.undo()
        try:
            found = resolve(path)
        except UsageError as err:  # an incomplete path: the error names the complete one beside it
            found = path.with_name("ckpt.old")
            assert f"HINT: the previous checkpoint, {found}, is complete" in str(err)
        assert not missing_parts(found), (dies_at, found)
        assert (found / META_FILE).read_text() in ("new" if finished else (good, "new")), dies_at
        if finished:
            assert dies_at >= 3  # it died in both renames and in a removal before
            assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
            break
    else:
        pytest.fail("the swap never finished")
