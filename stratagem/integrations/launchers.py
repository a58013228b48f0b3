"""The launchers the Lightning and Fabric strategies start a node's ranks with: Lightning's own
(rank 0 runs the script again for the other local ranks), watched by an observer that lets the
ranks name a lost peer before it ends them.

Lightning's observer polls the other local ranks every 5 s and, once one has exited with an
error, SIGKILLs every process of the node: the survivors died before they could say which rank
was lost (:class:`~stratagem.errors.PeerLost` takes a few seconds, :data:`NAMING_SECONDS`). This
observer first gives them :data:`GRACE_SECONDS` to end by themselves, which they do as soon as
their next collective fails; it ends what still runs after that, as Lightning's does.
"""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricLauncher,
)
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _TrainerLauncher,
)
from typing_extensions import override

from stratagem.distributed import NAMING_SECONDS

__all__ = ["GRACE_SECONDS", "FabricLauncher", "TrainerLauncher"]

GRACE_SECONDS = NAMING_SECONDS + 3.0
"""Seconds the ranks of a node get to end by themselves once one of them died."""


class _PatientObserver(_ChildProcessObserver):
    """Lightning's observer, ending the node's processes only :data:`GRACE_SECONDS` after a
    rank died (this thread, a daemon, ends with rank 0 when rank 0 exits first)."""

    @override
    def _terminate_all(self) -> None:
        time.sleep(GRACE_SECONDS)
        super()._terminate_all()


def _start(launcher: _FabricLauncher | _TrainerLauncher) -> None:
    """What Lightning's launchers do before calling the function, with the patient observer."""
    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not launcher.cluster_environment.creates_processes_externally:
        launcher._call_children_scripts()
        _PatientObserver(main_pid=os.getpid(), child_processes=launcher.procs).start()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)


class TrainerLauncher(_TrainerLauncher):
    """The Trainer's subprocess launcher with the patient observer (module docstring)."""

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _start(self)
        return function(*args, **kwargs)


class FabricLauncher(_FabricLauncher):
    """Fabric's subprocess launcher with the patient observer (module docstring)."""

    @override
    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        _start(self)
        return function(*args, **kwargs)
