"""Each input a careless user or script was seen to send, named: a clean usage error (exit 2 on
the command line), or the answer, in seconds."""

from __future__ import annotations

import json
import re

import pytest

from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.search.advice import advise
from stratagem.cli import main
from stratagem.errors import UsageError
from stratagem.integrations.planning import load_plan
from stratagem.plan import Plan, Workload

PLAN_TEXTS = {
    "tp_layout a number": ('{"tp_layout": 5}', "Plan.tp_layout must be a list"),
    "tp_layout null": ('{"tp_layout": null}', "Plan.tp_layout must be a list"),
    "tp_layout a string": ('{"tp_layout": "abc"}', "Plan.tp_layout must be a list"),
    "tp_layout pair of numbers": ('{"tp": 2, "tp_layout": [[1, 2]]}', "not a [pattern, style] pair"),
    "stage_blocks a number": ('{"stage_blocks": 5}', "Plan.stage_blocks must be a list"),
    "best plan not an object": ('{"plans": [1]}', "JSON object of Plan fields"),
    "plan entry not an object": ('{"plan": 5}', "unknown Plan field(s) plan"),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    "sequence_parallel as a string": ('{"tp": 2, "sequence_parallel": "false"}', "must be true or false"),
    "zero as a bool": ('{"zero": true, "dp_shard": 2}', "Plan.zero=True is not one of"),
    "zero as a float": ('{"zero": 3.0, "dp_shard": 2}', "Plan.zero=3.0 is not one of"),
    "block_container a number": ('{"block_container": 5}', "Plan.block_container must be a string"),
    "a degree of 10^30": ('{"dp_replicate": 1000000000000000000000000000000}', "more than 1,048,576"),
    "a batch of 2^32": ('{"micro_batch_size": 4294967296}', "Plan.global_batch_size=4294967296 is more than"),
}


@pytest.mark.parametrize(("text", "message"), PLAN_TEXTS.values(), ids=PLAN_TEXTS.keys())
def test_a_bad_plan_is_a_usage_error_through_every_way_in(tmp_path, text, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        Plan.from_json(text)
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(UsageError, match="Plan|plan"):
        load_plan(path)
    try:
        data = json.loads(text)
    except RecursionError:
        return
    if isinstance(data, dict) and "plans" not in data and "plan" not in data:
        with pytest.raises(UsageError, match="Plan"):
            load_plan(data)


def test_the_lightning_strategy_refuses_a_bad_plan_when_built():
    from stratagem.integrations.lightning import AutoParallelStrategy

    with pytest.raises(UsageError, match="must be true or false"):
        AutoParallelStrategy(plan={"tp": 2, "sequence_parallel": "false"})


def test_a_plan_loader_refuses_what_is_no_plan(tmp_path):
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    for plan, message in ((5, "not int"), (binary, "cannot read the plan file"), (tmp_path, "cannot read")):
        with pytest.raises(UsageError, match=message):
            load_plan(plan)


CLUSTERS = {
    "8·10^20 GPUs": ("99999999999999999999x8xH100:ib-ndr", "more ranks than any cluster holds"),
    "10^11 NICs": ("2x8xH100:ib-ndr-x99999999999", "more than one per device of the largest node"),
    "a letter no catalog name has": ("8xH100ü", "cannot read cluster spec"),
    "2,048 GPUs in a node": ("2048xH100", "more than any node or NVLink domain holds"),
    "1,024 H100s in one NVLink domain": ("1024xH100", "(?s)joins at most 256.*HINT.*'128x8xH100-SXM5-80GB:ib-ndr'"),
    "nine MI300X in one node": ("9xMI300X", "joins at most 8"),
    "counts and no device": ("8x", "(?s)'8x' names no device after its counts.*HINT: e.g. '8xH100'"),
}


def test_a_node_as_large_as_its_link_joins_is_read():
    assert parse_cluster("72xGB200").node.num_devices == 72
    assert parse_cluster("256xH100").node.num_devices == 256
    assert parse_cluster("64xA100-PCIe").node.num_devices == 64  # no largest PCIe tree is catalogued


@pytest.mark.parametrize(("spec", "message"), CLUSTERS.values(), ids=CLUSTERS.keys())
def test_a_cluster_no_one_has_is_refused(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_cluster(spec)


ARGUMENTS = {
    "sequence of 2^63": (["advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--seq-len", str(2**63)],
                         "--seq-len: must be at most 2,147,483,648"),
    "batch of 10^30": (["advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--global-batch-size", "1" + "0" * 30],
                       "--global-batch-size: must be at most"),
    "batch of 2^63": (["advise", "--model", "llama-tiny", "--global-batch-size", str(2**63)], "must be at most"),
    "empty output": (["advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--emit", "lightning", "--output="],
                     "'' is not a file name"),
    "a million ranks": (["verify", "--model", "llama-tiny", "--nproc", "1000000"], "must be at most 1,024"),
    "timeout nan": (["verify", "--model", "llama-tiny", "--timeout", "nan"], "must be more than 0"),
    "warm-up of -1": (["verify", "--model", "llama-tiny", "--warmup", "-1"], "must be at least 0"),
}


@pytest.mark.parametrize(("argv", "message"), ARGUMENTS.values(), ids=ARGUMENTS.keys())
def test_a_number_or_path_no_run_can_take_exits_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err and "Traceback" not in err


def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(capsys):
    assert main(["calibrate", "--output", "/proc/stratagem-calibration.json", "--json"]) == 2
    captured = capsys.readouterr()
    assert "cannot write the calibration to /proc/stratagem-calibration.json" in captured.err
    assert captured.out == ""  # nothing measured, nothing reported


def test_a_billion_samples_per_step_are_searched_in_seconds():
    profile = profile_spec("llama-tiny", seq_len=32)
    advice = advise(profile, parse_cluster("2xcpu"), Workload(global_batch_size=10**9, seq_len=32), top=1)
    assert advice.best is not None and advice.best.plan.global_batch_size == 10**9
    assert advice.search_seconds < 30  # was 104 s: the micro-batch enumeration's divisors took O(batch) steps


@pytest.mark.parametrize(("emit", "target"), [("deepspeed", "accelerate"), ("deepspeed", "lightning"),
                                              ("lightning", "any")])
def test_a_target_whose_plans_the_emitted_config_cannot_run_exits_2_before_profiling(capsys, emit, target):
    """``--emit deepspeed --target accelerate`` had written a DeepSpeed config for a plan chosen for
    Accelerate; ``--target lightning`` printed the whole report, then failed."""
    argv = ["advise", "--model", "llama-tiny", "--cluster", "2xcpu", "--emit", emit, "--target", target]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert f"--emit {emit} writes a config" in err and "HINT: leave --target out" in err and not out


def test_a_spec_with_three_counts_says_the_form(capsys):
    assert main(["hardware", "--cluster", "3x3x3xH100"]) == 2
    assert "has more than two counts" in capsys.readouterr().err


def test_a_gb200_nvl72_rack_takes_one_nic_per_gpu():
    """The network's default, one NIC per GPU, is 72 on an NVL72 rack (it had been refused: at most 64)."""
    assert parse_cluster("2x72xGB200:ib-ndr").node.network.nics_per_node == 72


def test_cpu_ranks_that_outnumber_the_cores_share_their_rate():
    """64 ranks on a 2-core host had each been given a whole core: 32 times the host's rate."""
    from stratagem.advisor.hardware.host import probe_host

    cores = probe_host().num_cores
    one, many = parse_cluster("1xcpu"), parse_cluster(f"{4 * cores}xcpu")
    assert many.device.peak_fp32 * 4 * cores == pytest.approx(one.device.peak_fp32)
    assert any("share this host's" in note for note in many.notes)
