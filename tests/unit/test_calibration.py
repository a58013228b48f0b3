"""Calibration data without processes: fits recover α and β, files round-trip, a calibration
applies only to the hardware it was taken on and replaces the catalog's figures there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from calibrations import bare_calibration

from stratagem.advisor.calibrate.calibration import (
    FORMAT_VERSION,
    UNCALIBRATED_NOTE,
    Calibration,
    LinkFit,
    calibrated,
    calibration_path,
    find_calibration,
    fit_link,
    hardware_key,
    stale_host_optimizer_note,
    stale_sgd_note,
)
from stratagem.advisor.cost.optimizer import (DTENSOR_FUSED_TENSOR_SECONDS, DTENSOR_OP_SECONDS,
                                               FUSED_TENSOR_PASSES, HOST_OPTIMIZER_BANDWIDTH_PER_NODE,
                                               estimate_optimizer_seconds)
from stratagem.advisor.cost.rank_step import rank_step
from stratagem.advisor.cost.rates import COPY_BANDWIDTH_FRACTION, seconds_per_op_byte
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.advisor.hardware.catalog import MAMF_SUSTAINED
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload
from stratagem.errors import UsageError

SIZES = (2**12, 2**16, 2**20, 2**24)


@pytest.mark.parametrize(("op", "n"), [("all_reduce", 4), ("all_gather", 8), ("reduce_scatter", 2), ("p2p", 2)])
def test_fit_recovers_latency_and_bandwidth(op: str, n: int) -> None:
    truth = LinkFit(latency=20e-6, bandwidth=50e9, points=())
    fit = fit_link(op, n, [(b, truth.seconds(op, n, b)) for b in SIZES])
    assert fit.latency == pytest.approx(truth.latency, rel=1e-6)
    assert fit.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_fit_clamps_noise() -> None:
    fit = fit_link("all_reduce", 2, [(1000, 2e-3), (2000, 1e-3)])  # time falling with size: noise
    assert fit.latency >= 0 and fit.bandwidth > 0
    with pytest.raises(UsageError, match="at least two message sizes"):
        fit_link("all_reduce", 2, [(1000, 1e-3)])


def _calibration(cluster: Cluster, **links: LinkFit) -> Calibration:
    return Calibration(
        hardware=hardware_key(cluster), backend="nccl", world_size=cluster.world_size,
        matmul={"bf16": ((4096, 650e12), (8192, 700e12)), "fp32": ((4096, 50e12),)}, memory_bandwidth=3.0e12,
        links={scope: {"all_reduce": {cluster.devices_per_node if scope == "intra" else cluster.world_size: fit}}
               for scope, fit in links.items()},
        overlap=0.7, op_seconds=4e-6, op_byte_seconds=2e-10, dtensor_optimizer_seconds=(2e-4, 1e-4),
        tp_linear_seconds=3e-4, sync_seconds={8: 2e-5, 16: 3e-5},
        optimizer_seconds={"adamw": (2e-11, 1e-5), "sgd": (3e-12, 2e-6)}, framework_bytes=300 * 2**20,
        seconds=42.0, unaligned_matmul={"bf16": 0.2}, host_optimizer_seconds={"adamw": (1.5e-9, 2e-5)},
        created="2026-11-22T00:00:00+00:00")


def test_apply_replaces_catalog_figures() -> None:
    cluster = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
    result = _calibration(cluster, intra=LinkFit(5e-6, 300e9, ()), inter=LinkFit(15e-6, 40e9, ())).apply(cluster)
    assert result.device.peak_bf16 == 700e12 and result.device.peak_fp32 == 50e12
    assert result.device.peak_fp16 == cluster.device.peak_fp16  # not measured: the catalog's
    assert result.device.memory_bandwidth == 3.0e12
    assert (result.node.link.bandwidth, result.node.link.latency, result.node.link.efficiency) == (300e9, 5e-6, 1.0)
    assert result.network.node_bandwidth * result.network.efficiency == pytest.approx(8 * 40e9)
    assert result.network.latency == 15e-6
    assert result.node.comm_overlap == 0.7 and Cluster.from_dict(result.to_dict()) == result
    assert result.node.collectives == (("all_reduce", 8, 300e9, 5e-6),)  # in-node fits only
    assert (result.node.op_seconds, result.node.op_byte_seconds, result.node.framework_bytes,
            result.node.tp_linear_seconds) == (4e-6, 2e-10, 300 * 2**20, 3e-4)
    assert result.node.sync_seconds == ((8, 2e-5), (16, 3e-5))  # per group size
    assert result.node.optimizer_seconds == (("adamw", 2e-11, 1e-5), ("sgd", 3e-12, 2e-6))
    assert result.node.host_optimizer_seconds == (("adamw", 1.5e-9, 2e-5),)
    assert result.node.dtensor_optimizer_seconds == (2e-4, 1e-4)
    assert result.node.unaligned_matmul == (("bf16", 0.2),)
    assert result.spec.startswith("2x8xH100") and any(n.startswith("calibrated:") for n in result.notes)


def test_measured_overlap_replaces_the_constant_in_the_time_model() -> None:
    from stratagem.advisor.cost.evaluate import evaluate
    from stratagem.plan import Plan, Workload
    from stratagem.advisor.profile.cache import profile_spec

    cluster = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
    profile = profile_spec("llama-2-7b", seq_len=4096)
    plan, workload = Plan(dp_shard=16, zero=3, micro_batch_size=1), Workload(global_batch_size=16, seq_len=4096)
    exposed = [evaluate(profile, dataclasses.replace(cluster, node=dataclasses.replace(cluster.node, comm_overlap=o)),
                        workload, plan).time.dp_comm for o in (None, 0.0, 1.0)]
    assert exposed[2] <= exposed[0] <= exposed[1]  # the 0.8 default sits between none and all hidden
    assert exposed[1] > exposed[2]


def test_a_calibrated_matmul_rate_is_achieved_already_and_a_catalog_peak_is_not() -> None:
    """The catalog's peak is discounted to what GEMMs reach; the benchmark measured what they
    reach, so its rate is used as it is (it was discounted twice before)."""
    from stratagem.advisor.cost import rank_step
    from stratagem.plan import Plan, Workload
    from stratagem.advisor.profile.cache import profile_spec

    cluster = parse_cluster("1xH100")
    profile = profile_spec("llama-tiny")
    plan, workload = Plan(), Workload(global_batch_size=1, seq_len=profile.seq_len)
    catalog = rank_step.rank_step(profile, cluster=cluster, workload=workload, plan=plan)
    assert catalog.flops_per_second == pytest.approx(792.1e12 * MAMF_SUSTAINED)  # the catalog's large GEMMs' rate
    measured = rank_step.rank_step(profile, cluster=_calibration(cluster).apply(cluster), workload=workload, plan=plan)
    assert measured.flops_per_second == 700e12


def test_a_calibrated_gpus_copy_prices_its_steps_memory_bound_bytes_as_the_catalogs_peak_does() -> None:
    """A GPU's calibration times a copy, not a step: its operators without FLOPs move their bytes
    at the copy's rate times the share a step's kernels reach of it, which puts the catalog's
    peak and a copy at the catalog's share of it on the same price. A CPU calibration times a
    reference step, whose rate is taken as it is."""

    h100 = parse_cluster("1xH100")
    copy = h100.device.memory_bandwidth * COPY_BANDWIDTH_FRACTION
    calibration = bare_calibration(memory_bandwidth=copy, op_byte_seconds=1 / copy)
    assert seconds_per_op_byte(calibration.apply(h100)) == pytest.approx(seconds_per_op_byte(h100))
    cpu = parse_cluster("2xcpu")
    assert seconds_per_op_byte(bare_calibration(op_byte_seconds=5e-10).apply(cpu)) == 5e-10


def test_each_collective_costs_its_own_fit_and_the_measured_overheads_apply() -> None:
    """A backend whose all-gathers are slower than its all-reduces makes FSDP slower, not DDP; the
    measured seconds per operator and framework memory reach the time and memory models."""
    from stratagem.advisor.cost.evaluate import evaluate
    from stratagem.plan import Plan, Workload
    from stratagem.advisor.profile.cache import profile_spec

    cluster = parse_cluster("4xcpu")
    profile = profile_spec("llama-tiny", seq_len=32, precision="fp32")
    workload = Workload(global_batch_size=8, seq_len=32, precision="fp32")
    ddp, fsdp = Plan(dp_replicate=4, micro_batch_size=2, precision="fp32"), \
        Plan(dp_shard=4, zero=3, micro_batch_size=2, precision="fp32", block_container="layers")
    base = _calibration(cluster, intra=LinkFit(1e-3, 1e9, ()))
    slow_gather = dataclasses.replace(base, links={"intra": {**base.links["intra"],
                                                             "all_gather": {4: LinkFit(5e-3, 1e9, ())}}})
    times = {(name, plan.name): evaluate(profile, c.apply(cluster), workload, plan).time
             for name, c in (("base", base), ("slow", slow_gather)) for plan in (ddp, fsdp)}
    assert times["slow", ddp.name].dp_comm_total == times["base", ddp.name].dp_comm_total
    assert times["slow", fsdp.name].dp_comm_total > times["base", fsdp.name].dp_comm_total
    ops = sum(s.fwd_ops + s.bwd_ops for s in profile.segments)
    assert ops > 0 and times["base", ddp.name].dispatch >= ops * 4e-6  # CPU ranks: all of it adds
    memory = evaluate(profile, base.apply(cluster), workload, ddp).memory
    assert memory.framework == 300 * 2**20 and memory.total > memory.framework


def test_a_measured_tp_linear_host_time_prices_every_tp_linear_of_every_microbatch() -> None:
    from stratagem.advisor.cost.evaluate import evaluate
    from stratagem.plan import Plan, Workload
    from stratagem.advisor.profile.cache import profile_spec

    cluster = parse_cluster("4xcpu")
    profile = profile_spec("llama-tiny", seq_len=32, precision="fp32")
    plan = Plan(tp=2, dp_shard=2, zero=3, tp_layout=profile.tp_layout, block_container=profile.block_container,
                micro_batch_size=2, grad_accum=2, precision="fp32")
    workload = Workload(global_batch_size=8, seq_len=32, precision="fp32")
    base = _calibration(cluster, intra=LinkFit(1e-3, 1e9, ()))
    slower = dataclasses.replace(base, tp_linear_seconds=base.tp_linear_seconds + 1e-3)
    added = (evaluate(profile, slower.apply(cluster), workload, plan).time.dispatch
             - evaluate(profile, base.apply(cluster), workload, plan).time.dispatch)
    linears = (sum(style in ("colwise", "rowwise") for _, style in profile.tp_layout) * len(profile.blocks)
               + len(plan.vocab_tp_styles))  # the embedding, the head and the loss on its shards (vocab_loss)
    assert plan.vocab_tp_styles == {"vocab_embedding", "vocab_head", "vocab_loss"}
    assert linears > 0 and added == pytest.approx(2 * linears * 1e-3)


def test_round_trip_and_lookup_by_hardware(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAGEM_CACHE_DIR", str(tmp_path))
    cluster = parse_cluster("8xA100-SXM4-80GB")
    assert find_calibration(cluster) is None  # the catalog's figures, and a note that says so
    assert calibrated(cluster) == dataclasses.replace(cluster, notes=(*cluster.notes, UNCALIBRATED_NOTE))
    assert UNCALIBRATED_NOTE in calibrated(parse_cluster("2xcpu")).notes  # CPU ranks too: a rough core's rates
    calibration = _calibration(cluster, intra=LinkFit(5e-6, 200e9, ((1, 1e-5), (2, 2e-5))))
    calibration.save(calibration_path(calibration.hardware))
    assert Calibration.load(calibration_path(calibration.hardware)) == calibration
    older = {**calibration.to_dict(), "version": 5}  # its per-byte cost meant bytes written
    with pytest.raises(UsageError, match="run `stratagem calibrate` again"):
        Calibration.from_dict(older)
    assert find_calibration(cluster) == calibration
    assert calibrated(cluster).device.peak_bf16 == 700e12
    assert find_calibration(parse_cluster("4xA100-SXM4-80GB")) is None  # other hardware


def test_unreadable_calibration_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"version": 0}')
    with pytest.raises(UsageError, match="run `stratagem calibrate` again"):
        Calibration.load(tmp_path / "c.json")
    with pytest.raises(UsageError, match="cannot read the calibration"):
        Calibration.load(tmp_path / "missing.json")


def test_an_offloaded_optimizer_steps_at_the_hosts_measured_rate() -> None:
    """FSDP2's CPU offload runs the optimizer on the host, fused as the plugins build it: at the
    seconds per parameter and per tensor calibrate measured there over DTensors (every rank of the
    node at once), its launches included; else the longer of streaming the fused kernel's passes
    at the catalog's host bandwidth and launching one DTensor call over every tensor (a tiny
    model's launches, a large one's streaming)."""
    profile = profile_spec("gpt2-tiny", seq_len=32)
    cluster = parse_cluster("1xH100-SXM-80GB")
    workload = Workload(global_batch_size=8, seq_len=32)
    plan = Plan(dp_shard=1, zero=3, offload="params", micro_batch_size=8, block_container=profile.block_container)
    measured = _calibration(cluster).apply(cluster)
    step = rank_step(profile, cluster=measured, workload=workload, plan=plan)
    tensors = sum(segment.num_tensors for segment in profile.segments)
    assert estimate_optimizer_seconds(step) == pytest.approx(step.optimizer_params * 1.5e-9 + tensors * 2e-5)
    launches = DTENSOR_OP_SECONDS + tensors * DTENSOR_FUSED_TENSOR_SECONDS
    assert estimate_optimizer_seconds(rank_step(profile, cluster=cluster, workload=workload, plan=plan)) == launches
    large = profile_spec("gpt2-medium", seq_len=32)
    catalog = rank_step(large, cluster=cluster, workload=workload, plan=plan)
    assert estimate_optimizer_seconds(catalog) == pytest.approx(
        catalog.optimizer_params * FUSED_TENSOR_PASSES["adamw"] * 4 / HOST_OPTIMIZER_BANDWIDTH_PER_NODE)
    older = {**_calibration(cluster).to_dict()}
    del older["host_optimizer_seconds"]  # a calibration from before the host's step was measured
    assert Calibration.from_dict(older).apply(cluster).node.host_optimizer_seconds == ()


@pytest.mark.parametrize(("name", "version"), [("h200-sxm-141gb-2026-11-28", 8), ("h200-sxm-141gb-2026-11-28b", 9)])
def test_an_older_calibration_drops_its_host_optimizer_figure_and_says_why(name: str, version: int) -> None:
    """Format 8 timed the host's optimizer over tensors a server's cache holds (an H200's host: 850
    GB/s), format 9 over DTensors whose shards ``from_local`` had moved onto the GPU (6 ps a
    parameter): read now, the rest of such a file stands and the catalog's figure stands for that one."""
    stored = Calibration.load(Path(__file__).parents[2] / "bench" / "calibrations" / f"{name}.json")
    assert stored.host_optimizer_seconds is None and stale_host_optimizer_note(version) in stored.notes
    assert stored.memory_latency == pytest.approx(459e-9, rel=0.03) and stored.version == FORMAT_VERSION


def test_a_format_11_sgd_figure_timed_without_momentum_is_dropped() -> None:
    """Format 11 timed torch's default SGD, without momentum, where the cost model's SGD keeps it
    (its buffer in memory, its passes in time): SGD's figures are dropped, AdamW's stand."""
    cluster = parse_cluster("1xH100-SXM-80GB")
    current = _calibration(cluster)
    older = {**current.to_dict(), "version": 11}
    older["host_optimizer_seconds"] = {"adamw": (1.4e-9, 3e-5), "sgd": (3e-10, 5e-6)}
    read = Calibration.from_dict(older)
    assert "sgd" in (current.optimizer_seconds or {}) and stale_sgd_note(11) in read.notes
    assert read.optimizer_seconds == {k: v for k, v in current.optimizer_seconds.items() if k != "sgd"}
    assert read.host_optimizer_seconds == {"adamw": (1.4e-9, 3e-5)}
    assert not any("SGD" in note for note in Calibration.from_dict(current.to_dict()).notes)


def test_a_format_10_host_figure_timed_one_tensor_at_a_time_is_dropped() -> None:
    """Format 10 timed the host's optimizer on torch's default path, one tensor at a time; the
    plugins step offloaded parameters fused now, several times faster: the figure is dropped."""
    cluster = parse_cluster("1xH100-SXM-80GB")
    older = {**_calibration(cluster).to_dict(), "version": 10}
    read = Calibration.from_dict(older)
    assert read.host_optimizer_seconds is None and stale_host_optimizer_note(10) in read.notes
    assert read.optimizer_seconds["adamw"] == _calibration(cluster).optimizer_seconds["adamw"]  # the device's stands


def test_a_format_12_wait_after_compute_reads_as_the_whole_worlds() -> None:
    """Before format 13 calibration measured a collective's wait after compute over every rank
    alone: read now, it is that group size's figure, which smaller groups take until
    `stratagem calibrate` measures theirs."""
    cluster = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
    older = {**_calibration(cluster).to_dict(), "version": 12, "sync_seconds": 2e-5}
    read = Calibration.from_dict(older)
    assert read.sync_seconds == {16: 2e-5} and read.apply(cluster).node.sync_seconds == ((16, 2e-5),)
    assert Calibration.from_dict(_calibration(cluster).to_dict()).sync_seconds == {8: 2e-5, 16: 3e-5}
