"""Calibration: measure the cluster as it is, and let the cost model use what was measured.

:mod:`.calibration` holds the data and applies it (no torch); :mod:`.benchmarks` and :mod:`.run`
measure on a live process group.
"""

from stratagem.advisor.calibrate.calibration import Calibration, calibrated, find_calibration

__all__ = ["Calibration", "calibrated", "find_calibration"]
