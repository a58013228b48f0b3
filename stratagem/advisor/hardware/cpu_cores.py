"""What this host's cores compute with: their vector units' class and half-precision extensions,
read from ``/proc/cpuinfo`` with the CPU's name, and their nominal clock, from sysfs or that name.

The class names a row of :data:`~stratagem.advisor.hardware.catalog.CPU_CORES` (fp32 FLOPs a cycle);
:func:`~stratagem.advisor.hardware.lookup.cpu_device` turns both into a core's peak
(docs/hardware.md, "CPU ranks").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from stratagem.advisor.hardware import catalog

AMD = "AuthenticAMD"
ZEN4_FAMILY = 0x19  # Zen 3 and Zen 4; only Zen 4 has AVX-512
ZEN_FAMILY = 0x17  # Zen, Zen+ (models below 0x30: 128-bit FMA pipes) and Zen 2
ZEN2_FIRST_MODEL = 0x30


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """One core as ``/proc/cpuinfo`` and sysfs describe it."""

    isa: str  # a key of catalog.CPU_CORES, "" where unknown
    extensions: tuple[str, ...]  # flags of catalog.CPU_HALF_UNITS the core has
    clock_hz: float | None  # nominal clock; None where nothing says
    name: str = ""  # cpuinfo's model name


def probe_cores(cpuinfo: Path = Path("/proc/cpuinfo"), cpus: Path = Path("/sys/devices/system/cpu")) -> CoreInfo:
    """The first core's class, half-precision extensions, nominal clock and model name (unknowns empty)."""
    try:
        fields = _first_processor(cpuinfo.read_text())
    except OSError:
        return CoreInfo("", (), None)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    extensions = tuple(sorted(flags & set(catalog.CPU_HALF_UNITS)))
    return CoreInfo(core_class(fields, flags), extensions, nominal_clock(fields, cpus), fields.get("model name", ""))


def _first_processor(text: str) -> dict[str, str]:
    """``key: value`` fields of the first processor's paragraph (an Arm kernel writes some after it)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def core_class(fields: dict[str, str], flags: set[str]) -> str:
    """The row of ``catalog.CPU_CORES`` a core's vendor, family, model and flags name ("" where none)."""
    amd = fields.get("vendor_id") == AMD
    family, model = _int(fields.get("cpu family")), _int(fields.get("model"))
    if "asimd" in flags:
        return "neon"
    if "avx512f" in flags:
        return "avx512-256" if amd and family == ZEN4_FAMILY else "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2-128" if amd and family == ZEN_FAMILY and model < ZEN2_FIRST_MODEL else "avx2"
    if "avx" in flags:
        return "avx"
    return "sse" if "sse2" in flags else ""


def nominal_clock(fields: dict[str, str], cpus: Path) -> float | None:
    """Hz of the core's nominal clock: intel_pstate's ``base_frequency``, else the ``@ 2.10GHz`` of
    an Intel name, else cpufreq's ``cpuinfo_max_freq`` (the top P-state; with boost counted, above
    an all-core clock), else the ``cpu MHz`` cpuinfo reports (a virtual machine's nominal clock; on
    bare metal the current one, low when idle); None where none is there."""
    base = _khz(cpus / "cpu0" / "cpufreq" / "base_frequency")
    if base:
        return base
    named = re.search(r"@\s*([\d.]+)\s*GHz", fields.get("model name", ""))
    if named:
        return float(named.group(1)) * 1e9
    top = _khz(cpus / "cpu0" / "cpufreq" / "cpuinfo_max_freq")
    if top:
        return top
    try:
        return float(fields["cpu MHz"]) * 1e6
    except (KeyError, ValueError):
        return None


def _khz(path: Path) -> float | None:
    """Hz of a cpufreq file's kHz, None where it is absent or unreadable."""
    try:
        return int(path.read_text()) * 1e3
    except (OSError, ValueError):
        return None


def _int(text: str | None) -> int:
    """A decimal cpuinfo field, -1 where absent."""
    try:
        return int(text or "")
    except ValueError:
        return -1
