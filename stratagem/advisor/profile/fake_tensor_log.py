"""FakeTensorMode's own error log, silenced where the profile reports a failing operator itself."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Silence FakeTensorMode's own error log: a failing op is reported once, by the caller."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
