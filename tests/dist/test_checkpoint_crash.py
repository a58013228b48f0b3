"""A rank killed while a sharded checkpoint overwrites an older one leaves the older one loadable.

Two ranks train llama-tiny under ZeRO-3 for two steps and save (the good checkpoint, step 2, whose
full weights and optimizer state rank 0 also writes aside), train a third step and save to the
same path again, while rank 1 kills itself (SIGKILL) as soon as it has written part of its shard.
Fresh ranks then resume from the path: they get step 2's state, bit for bit (loading copies
shards, it sums nothing), and their next save leaves one complete checkpoint and no remains of
the crashed one.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import run_on_ranks
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.multiprocessing.spawn import ProcessException
from training import SEED, Case, dp_rank, global_batches, micro_batches

from stratagem.plan import Plan
from stratagem.plugins import apply_plan, build_mesh, build_optimizer
from stratagem.plugins.state_dict import (
    MANIFEST_FILE,
    is_sharded_checkpoint,
    load_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_sharded_checkpoint,
)

CASE = Case("crash", Plan(dp_shard=2, zero=3, micro_batch_size=2, precision="fp32", block_container="layers"))
KILLED = "killed"
"""The file the killed rank leaves beside the checkpoint just before it dies."""


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = apply_plan(CASE.model.build(), CASE.plan, build_mesh(CASE.plan, device_type="cpu"))
    return model, build_optimizer(model, CASE.plan, torch.optim.AdamW, lr=1e-3)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int) -> None:
    batches = global_batches(CASE)
    for step in steps:
        inputs, targets = batches[step]
        for micro_inputs, micro_targets in micro_batches(inputs, targets, CASE.plan, rank=dp_rank(CASE.plan, rank)):
            CASE.model.loss(model(*micro_inputs), micro_targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def _save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    checkpoint = {"state_dict": model_state_dict(model, full=False),
                  "optimizer_states": [optimizer_state_dict(model, optimizer, full=False)], "step": step}
    save_sharded_checkpoint(path, checkpoint, [optimizer])


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole weights and optimizer state on rank 0 (a collective)."""
    return {"model": model_state_dict(model, full=True), "optimizer": optimizer_state_dict(model, optimizer, full=True)}


@contextmanager
def _dying_stream(create_stream: Any, folder: Path, fs: FileSystem, path: Any, mode: str) -> Any:
    """``FileSystem.create_stream``, but a shard's stream writes half of its first write, then
    kills this process."""
    with create_stream(fs, path, mode) as stream:
        if mode == "wb" and str(path).endswith(".distcp"):
            write = stream.write

            def write_half_then_die(data: Any) -> int:
                view = memoryview(data).cast("B")
                write(view[:max(1, len(view) // 2)])
                stream.flush()
                (folder / KILLED).write_text(str(path))
                os.kill(os.getpid(), signal.SIGKILL)
                return 0

            stream.write = write_half_then_die
        yield stream


def save_then_crash(rank: int, world_size: int, folder: Path) -> None:
    """Train and save the good checkpoint, then overwrite it while rank 1 dies mid-shard."""
    model, optimizer = _build(SEED)
    _train(model, optimizer, range(2), rank)
    _save(folder / "ckpt", model, optimizer, step=2)
    expected = _full_state(model, optimizer)
    if rank == 0:
        torch.save(expected, folder / "expected.pt")
    _train(model, optimizer, range(2, 3), rank)
    if rank == 1:
        original = FileSystem.create_stream
        FileSystem.create_stream = lambda fs, path, mode: _dying_stream(  # type: ignore[method-assign]
            original, folder, fs, path, mode)
    dist.barrier()  # rank 1 armed
    _save(folder / "ckpt", model, optimizer, step=3)
    raise AssertionError("the save should not have finished: rank 1 was to die in it")


def resume_then_save(rank: int, world_size: int, folder: Path) -> dict[str, Any]:
    """Fresh ranks (other initial weights) load the path; what they hold, then save again."""
    model, optimizer = _build(SEED + 1)
    rest = load_checkpoint(folder / "ckpt", model, [optimizer])
    loaded = {"step": rest["step"], **_full_state(model, optimizer)}
    _save(folder / "ckpt", model, optimizer, step=rest["step"])
    return loaded


def _assert_identical(got: Any, expected: Any, where: str = "") -> None:
    assert type(got) is type(expected), where
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            _assert_identical(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected)):
            _assert_identical(a, b, f"{where}/{index}")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    else:
        assert got == expected, where


@pytest.mark.timeout(120)
def test_a_rank_killed_while_overwriting_leaves_the_last_good_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ProcessException):
        run_on_ranks(save_then_crash, tmp_path, world_size=2)
    assert (tmp_path / KILLED).is_file()  # rank 1 died inside the second save
    leftovers = list(tmp_path.glob("ckpt.partial-*"))
    assert len(leftovers) == 1 and not (leftovers[0] / MANIFEST_FILE).exists()
    expected = torch.load(tmp_path / "expected.pt", weights_only=False)

    loaded = run_on_ranks(resume_then_save, tmp_path, world_size=2)
    assert loaded["step"] == 2
    _assert_identical(loaded["model"], expected["model"], "model")
    _assert_identical(loaded["optimizer"], expected["optimizer"], "optimizer")
    assert is_sharded_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "expected.pt", KILLED]
