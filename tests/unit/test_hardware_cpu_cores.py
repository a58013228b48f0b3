"""A CPU rank's peak from its cores' vector units and clock, read from fake /proc/cpuinfo files and
sysfs trees (and this host's own, against what lscpu reads)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stratagem.advisor.hardware import catalog, parse_cluster
from stratagem.advisor.hardware.cpu_cores import CoreInfo, probe_cores
from stratagem.advisor.hardware.host import num_sockets
from stratagem.advisor.hardware.lookup import core_peaks, cpu_device
from stratagem.advisor.hardware.spec import HostSpec

ZEN4 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC
cpu MHz		: 2596.128
flags		: fpu sse sse2 avx fma avx2 avx512f avx512_bf16 avx512vl

processor	: 1
vendor_id	: AuthenticAMD
cpu MHz		: 1800.000
"""
SAPPHIRE_RAPIDS = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
cpu MHz		: 800.000
flags		: sse2 avx fma avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile
"""
HASWELL = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 63
model name	: Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz
cpu MHz		: 1200.000
flags		: sse2 avx fma avx2
"""
ZEN1 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 23
model		: 1
model name	: AMD EPYC 7601 32-Core Processor
cpu MHz		: 2200.000
flags		: sse2 avx fma avx2
"""
GRAVITON2 = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
CPU implementer	: 0x41
"""


def _probe(tmp_path, text: str, **cpufreq_khz: int) -> CoreInfo:
    """``text`` as /proc/cpuinfo, and cpu0's cpufreq files (``base_frequency=…``) in a fake sysfs."""
    (tmp_path / "cpuinfo").write_text(text)
    cpus = tmp_path / "cpu"
    (cpus / "cpu0" / "cpufreq").mkdir(parents=True, exist_ok=True)
    for name, khz in cpufreq_khz.items():
        (cpus / "cpu0" / "cpufreq" / name).write_text(f"{khz}\n")
    return probe_cores(tmp_path / "cpuinfo", cpus)


def _host(core: CoreInfo, *, cores: int = 8, sockets: int = 1) -> HostSpec:
    return HostSpec(num_cores=cores, num_physical_cores=cores, memory_bytes=2**34, core_isa=core.isa,
                    isa_extensions=core.extensions, clock_hz=core.clock_hz, num_sockets=sockets)


def test_zen4_runs_avx512_on_256_bit_pipes_and_bf16_at_twice_fp32(tmp_path):
    """Zen 4: 32 fp32 FLOPs a cycle (AVX-512 in two halves), VDPBF16PS twice that, no fp16 units:
    torch's unvectorized fp16 kernels; the clock is the first processor's cpu MHz."""
    core = _probe(tmp_path, ZEN4)
    assert core == CoreInfo("avx512-256", ("avx512_bf16",), 2596.128e6, "AMD EPYC")
    peaks = core_peaks(_host(core))
    assert peaks["fp32"] == pytest.approx(32 * 2596.128e6)
    assert peaks["bf16"] == pytest.approx(2 * peaks["fp32"])
    assert peaks["fp16"] == pytest.approx(catalog.CPU_FP16_UNVECTORIZED.value * 2596.128e6)


def test_sapphire_rapids_takes_intel_pstates_base_clock_and_its_half_units(tmp_path):
    """Two 512-bit FMA units; bf16 and fp16 both native; sysfs's base_frequency, not the idle 800 MHz."""
    core = _probe(tmp_path, SAPPHIRE_RAPIDS, base_frequency=2_000_000, cpuinfo_max_freq=3_800_000)
    assert core == CoreInfo("avx512", ("amx_bf16", "avx512_bf16", "avx512_fp16"), 2.0e9,
                           "Intel(R) Xeon(R) Platinum 8480+")
    peaks = core_peaks(_host(core))
    assert peaks == pytest.approx({"fp32": 128e9, "bf16": 256e9, "fp16": 256e9})


def test_an_intel_name_gives_the_nominal_clock_where_sysfs_has_none(tmp_path):
    core = _probe(tmp_path, HASWELL)
    assert core == CoreInfo("avx2", (), 2.5e9, "Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz")
    assert core_peaks(_host(core))["bf16"] == core_peaks(_host(core))["fp32"] == pytest.approx(80e9)


def test_bare_metal_without_a_base_clock_takes_the_top_p_state_not_an_idle_clock(tmp_path):
    """An AMD host on acpi-cpufreq: no base_frequency, no clock in its name, cpu MHz whatever the
    core ran at when read; cpufreq's cpuinfo_max_freq stands for the clock."""
    assert _probe(tmp_path, ZEN4, cpuinfo_max_freq=3_700_000).clock_hz == 3.7e9


def test_first_zen_splits_256_bit_work_over_128_bit_pipes(tmp_path):
    assert _probe(tmp_path, ZEN1).isa == "avx2-128"
    assert core_peaks(_host(_probe(tmp_path, ZEN1)))["fp32"] == pytest.approx(16 * 2.2e9)


@pytest.mark.parametrize("text", [GRAVITON2, "", None], ids=["arm-without-clock", "empty", "absent"])
def test_a_core_whose_class_or_clock_is_unknown_gets_the_catalogs_guess(tmp_path, text):
    core = probe_cores(tmp_path / "absent", tmp_path) if text is None else _probe(tmp_path, text)
    assert core.clock_hz is None
    assert core_peaks(_host(core)) == dict.fromkeys(("fp32", "bf16", "fp16"), catalog.CPU_FLOPS_PER_CORE.value)


def test_a_ranks_bandwidth_is_its_cores_streams_up_to_its_share_of_the_sockets():
    """Two ranks of a 2-core host stream a core each; 2 ranks of a 64-core socket are held to half
    its channels; a second socket doubles them."""
    core = CoreInfo("avx2", (), 3e9)
    stream, socket = catalog.CPU_CORE_STREAM.value, catalog.CPU_SOCKET_BANDWIDTH.value
    assert cpu_device(_host(core, cores=2), num_ranks=2).memory_bandwidth == pytest.approx(stream)
    assert cpu_device(_host(core, cores=64), num_ranks=2).memory_bandwidth == pytest.approx(socket / 2)
    assert cpu_device(_host(core, cores=64, sockets=2), num_ranks=2).memory_bandwidth == pytest.approx(socket)
    device = cpu_device(_host(core, cores=2), num_ranks=4)  # ranks outnumber the cores: a turn on one
    assert device.peak_fp32 == pytest.approx(0.5 * 32 * 3e9)
    assert device.peak_fp16 == pytest.approx(0.5 * catalog.CPU_FP16_UNVECTORIZED.value * 3e9)


def test_fp16_without_vector_units_runs_on_one_thread_of_a_rank():
    """torch's reference fp16 GEMMs do not split across threads: a rank of 8 cores runs them at
    one core's rate, while its fp32 and a core with AVX512-FP16 use all eight."""
    plain = cpu_device(_host(CoreInfo("avx2", (), 3e9), cores=8), num_ranks=1)
    assert plain.peak_fp32 == pytest.approx(8 * 32 * 3e9)
    assert plain.peak_fp16 == pytest.approx(catalog.CPU_FP16_UNVECTORIZED.value * 3e9)
    native = cpu_device(_host(CoreInfo("avx512", ("avx512_fp16",), 3e9), cores=8), num_ranks=1)
    assert native.peak_fp16 == pytest.approx(8 * 2 * 64 * 3e9)


def test_sockets_are_counted_by_package(tmp_path):
    for cpu, package in enumerate((0, 0, 1, 1)):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "physical_package_id").write_text(f"{package}\n")
    assert num_sockets(tmp_path) == 2 and num_sockets(tmp_path / "absent") == 1


def test_the_host_spec_round_trips_through_json_with_its_core():
    host = _host(CoreInfo("avx512", ("avx512_bf16",), 2e9), sockets=2)
    assert HostSpec.from_dict(json.loads(json.dumps(host.to_dict()))) == host
    assert HostSpec.from_dict({"num_cores": 2, "num_physical_cores": 2, "memory_bytes": 1}).core_isa == ""


def test_this_hosts_cpu_ranks_take_its_cores_figures():
    """The real /proc/cpuinfo: a CPU cluster's rank runs at its cores' peak, as the flags lscpu
    prints name the class (skipped where lscpu or the flags are missing)."""
    import shutil
    import subprocess

    if shutil.which("lscpu") is None:
        pytest.skip("no lscpu here")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags:")), None)
    if not flags or "avx2" not in flags:
        pytest.skip("lscpu prints no x86 flags here")
    cluster = parse_cluster("1xcpu")
    host = cluster.node.host
    assert host.core_isa.startswith("avx512" if "avx512f" in flags else "avx2")
    assert ("avx512_bf16" in host.isa_extensions) == ("avx512_bf16" in flags)
    one = dataclasses.replace(host, num_cores=1)
    assert cpu_device(one, num_ranks=1).peak_fp32 == pytest.approx(core_peaks(host)["fp32"])


@pytest.mark.parametrize(("units", "precision", "noted"), [
    ((), "fp16-mixed", True), ((), "bf16-mixed", False), (("avx512_fp16",), "fp16-mixed", False),
])
def test_advise_says_when_fp16_runs_unvectorized_on_cpu_ranks(units, precision, noted):
    """fp16 asked of cores without fp16 units is priced at their reference kernels' rate, and the
    advice says so and names the precision that runs vectorized."""
    from stratagem.advisor.hardware.host import cpu_node
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.advisor.search.advice import advise
    from stratagem.plan import Workload

    host = _host(CoreInfo("avx512", units, 3e9), cores=4)
    cluster = dataclasses.replace(parse_cluster("2xcpu"), node=cpu_node(host, num_ranks=2, network=None))
    advice = advise(profile_spec("llama-tiny", seq_len=32), cluster,
                    Workload(global_batch_size=4, seq_len=32, precision=precision), top=1)
    notes = [note for note in advice.notes if "no fp16 vector units" in note]
    assert bool(notes) == noted
    if noted:
        assert "6.0 GFLOP/s a rank" in notes[0] and "bf16-mixed is the 16-bit precision" in notes[0]
