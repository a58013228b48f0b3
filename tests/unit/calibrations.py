"""A calibration with nothing measured but what a test gives it (pytest puts this folder on
sys.path): the fields every :class:`Calibration` needs, empty, for the tests that apply one."""

from __future__ import annotations

from typing import Any

from stratagem.advisor.calibrate.calibration import Calibration


def bare_calibration(**measured: Any) -> Calibration:
    """A one-process NCCL calibration measuring only ``measured`` (and a 3 TB/s copy)."""
    fields: dict[str, Any] = dict(
        hardware="h", backend="nccl", world_size=1, matmul={}, unaligned_matmul={}, memory_bandwidth=3e12,
        links={}, overlap=None, op_seconds=None, op_byte_seconds=None, dtensor_optimizer_seconds=None,
        tp_linear_seconds=0.0, optimizer_seconds=None, sync_seconds=None, framework_bytes=None, seconds=1.0,
        created="2026-11-27T00:00:00+00:00")
    return Calibration(**{**fields, **measured})
