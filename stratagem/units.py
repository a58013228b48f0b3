"""Human-readable numbers (bytes in binary units, counts and FLOPs in decimal ones, seconds) and lists."""

from __future__ import annotations

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ("", "K", "M", "G", "T", "P", "E")


def format_bytes(num_bytes: float) -> str:
    """``1536`` → ``'1.5 KiB'``; ``1000 * 2**20`` → ``'1.0 GiB'``."""
    value = float(num_bytes)
    for unit in _BINARY:
        if abs(value) < 1000 or unit == _BINARY[-1]:  # at most three digits before the point
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(count: float, suffix: str = "") -> str:
    """``124_439_808`` → ``'124.4M'``; ``format_count(3.2e12, 'FLOP')`` → ``'3.2 TFLOP'``."""
    value = float(count)
    for prefix in _DECIMAL:
        if abs(value) < 1000 or prefix == _DECIMAL[-1]:
            sep = " " if suffix else ""
            number = f"{value:.0f}" if prefix == "" else f"{value:.1f}"
            return f"{number}{sep}{prefix}{suffix}"
        value /= 1000
    raise AssertionError("unreachable")


def format_params(count: float) -> str:
    """Parameter counts the way model names write them: ``6_738_415_616`` → ``'6.7B'``."""
    return format_count(count).replace("G", "B")


def format_seconds(seconds: float) -> str:
    """``1.234`` → ``'1.23 s'``; ``0.0412`` → ``'41.2 ms'``; ``0`` → ``'0 s'``."""
    if seconds == 0:
        return "0 s"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(seconds) >= scale or unit == "µs":
            value = seconds / scale
            decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{decimals}f} {unit}"
    raise AssertionError("unreachable")


def format_list(items: list[str] | tuple[str, ...], first: int = 4) -> str:
    """The first ``first`` of ``items``, then how many more: ``'a, b, c, d and 2 more'``."""
    more = len(items) - first
    return ", ".join(items[:first]) + (f" and {more} more" if more > 0 else "")
