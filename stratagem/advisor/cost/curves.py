"""Reading a measured curve between its points: what the calibrated matmul and attention rates
are looked up with."""

from __future__ import annotations

import math
from collections.abc import Sequence


def log_interpolated(points: Sequence[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` on ``points`` (``(x, y)`` sorted by ``x``): linear in ``log x`` between
    them, the nearest end's ``y`` beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]
