"""Plan → Accelerate YAML: every emitted file loads with accelerate's own loader, goes through
`accelerate launch`'s own argument handling, and builds the plugins the plan asks for.

`accelerate launch` turns the file into FSDP_* / PARALLELISM_CONFIG_* / ACCELERATE_DEEPSPEED_*
variables and starts torchrun (or deepspeed) with them. GPUs are what we lack, so the launcher
that would start the processes is replaced by one that keeps the environment it was given; the
plugins are then built from that environment, as each launched process builds them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import yaml
from accelerate.commands import launch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

import stratagem.integrations.accelerate as acc
from stratagem.advisor.cost.evaluate import evaluate
from stratagem.advisor.search.explain import explain_target_cost
from stratagem.advisor.hardware import parse_cluster
from stratagem.plan import Plan, Workload
from stratagem.advisor.profile.cache import profile_spec
from stratagem.cli import main
from stratagem.errors import UsageError

TWO_NODES = parse_cluster("2x8xH100-SXM-80GB:ib-ndr")
ONE_NODE = parse_cluster("8xH100-SXM-80GB")
BLOCKS = ("TransformerBlock",)

# name → (plan, cluster, through DeepSpeed)
CASES = {
    "ddp": (Plan(dp_replicate=8, grad_accum=2), ONE_NODE, False),
    "fsdp2-zero3-ckpt-offload": (Plan(dp_shard=8, zero=3, activation_checkpointing="full", offload="params"),
                                 ONE_NODE, False),
    "fsdp2-zero2-fp16": (Plan(dp_shard=8, zero=2, precision="fp16-mixed"), ONE_NODE, False),
    "hsdp-multinode": (Plan(dp_replicate=2, dp_shard=8, zero=3), TWO_NODES, False),
    "tp-fsdp": (Plan(tp=4, dp_shard=2, zero=3), ONE_NODE, False),
    "deepspeed-zero1": (Plan(dp_shard=8, zero=1, precision="fp32"), ONE_NODE, True),
    "deepspeed-zero2-offload": (Plan(dp_shard=8, zero=2, offload="optimizer", grad_accum=4), ONE_NODE, True),
    "deepspeed-zero3-multinode": (Plan(dp_shard=16, zero=3, offload="params"), TWO_NODES, True),
}


def _launch_env(path) -> tuple[str, dict[str, str]]:
    """Run `accelerate launch --config_file path` up to starting processes: which launcher it
    picks, and the environment it would start them with."""
    seen: dict[str, tuple[str, dict[str, str]]] = {}

    def keep(name, prepare):
        return lambda args: seen.setdefault("launch", (name, prepare(args)))

    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    deepspeed_env = keep("deepspeed", lambda a: prepare_deepspeed_cmd_env(a)[1])
    with mock.patch.object(launch, "multi_gpu_launcher", keep("torchrun", prepare_multi_gpu_env)), \
            mock.patch.object(launch, "deepspeed_launcher", deepspeed_env), \
            mock.patch.object(launch, "simple_launcher", keep("one process", lambda a: {})):
        launch.launch_command(args)
    return seen["launch"]


@pytest.mark.parametrize("name", CASES)
def test_emitted_file_loads_and_builds_its_plugins(name, tmp_path):
    plan, cluster, deepspeed = CASES[name]
    path = acc.export_accelerate_config(plan, cluster, tmp_path / "accelerate.yaml", block_classes=BLOCKS,
                                        deepspeed=deepspeed)
    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == plan.world_size and loaded.num_machines == cluster.num_nodes
    assert loaded.distributed_type.value == acc.distributed_type(plan, deepspeed=deepspeed)
    assert loaded.mixed_precision == acc.MIXED_PRECISION[plan.precision]

    launcher, env = _launch_env(path)
    assert launcher == ("deepspeed" if deepspeed else "torchrun")
    with mock.patch.dict(os.environ, env):
        if deepspeed:
            _check_deepspeed(plan, DeepSpeedPlugin())
        elif plan.zero >= 2:
            _check_fsdp(plan, FullyShardedDataParallelPlugin())
        parallel = env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true"
        assert parallel == (not deepspeed and (plan.tp > 1 or plan.dp_replicate > 1 and plan.zero >= 2))
        if parallel:
            mesh = ParallelismConfig()
            assert (mesh.dp_replicate_size, mesh.dp_shard_size, mesh.tp_size) == (plan.dp_replicate, plan.dp_shard,
                                                                                   plan.tp)


def _check_fsdp(plan: Plan, plugin: FullyShardedDataParallelPlugin) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (plan.zero == 3)
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is (plan.offload == "params")
    assert plugin.activation_checkpointing is (plan.activation_checkpointing == "full")
    assert plugin.transformer_cls_names_to_wrap == list(BLOCKS)
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"


def _check_deepspeed(plan: Plan, plugin: DeepSpeedPlugin) -> None:
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == zero["stage"] == plan.zero
    assert zero["offload_optimizer"]["device"] == ("cpu" if plan.offload != "none" else "none")
    assert zero["offload_param"]["device"] == ("cpu" if plan.offload == "params" else "none")
    assert plugin.gradient_accumulation_steps == plan.grad_accum


@pytest.mark.parametrize("name", CASES)
def test_accelerator_kwargs_build_the_same_plugins(name):
    plan, _, deepspeed = CASES[name]
    kwargs = acc.accelerator_kwargs(plan, block_classes=BLOCKS, deepspeed=deepspeed)
    assert kwargs["gradient_accumulation_steps"] == plan.grad_accum
    assert kwargs["mixed_precision"] == acc.MIXED_PRECISION[plan.precision]
    if deepspeed:
        _check_deepspeed(plan, kwargs["deepspeed_plugin"])
    elif plan.zero >= 2:
        _check_fsdp(plan, kwargs["fsdp_plugin"])
    else:
        assert "fsdp_plugin" not in kwargs and "deepspeed_plugin" not in kwargs
    assert ("parallelism_config" in kwargs) == (plan.tp > 1 or plan.dp_replicate > 1 and plan.zero >= 2)


GOLDEN = Path(__file__).with_name("golden") / f"accelerate-{acc.accelerate_version()}"
GOLDEN_CASES = {
    "hsdp-2-nodes.yaml": (Plan(dp_replicate=2, dp_shard=8, zero=3, activation_checkpointing="full", grad_accum=2),
                          TWO_NODES, False),
    "deepspeed-zero2-offload.yaml": (Plan(dp_shard=8, zero=2, offload="optimizer", grad_accum=4), ONE_NODE, True),
    "ddp-2-cpu.yaml": (Plan(dp_replicate=2, precision="fp32"), parse_cluster("2xcpu"), False),
}


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_output_matches_the_golden_file_of_this_accelerate(name, tmp_path):
    """One folder per accelerate version: a new version's output is reviewed, then pinned."""
    if not GOLDEN.is_dir():
        pytest.skip(f"no golden files for accelerate {acc.accelerate_version()}: review the output, then "
                    f"write them to {GOLDEN}")
    plan, cluster, deepspeed = GOLDEN_CASES[name]
    path = acc.export_accelerate_config(plan, cluster, tmp_path / name, block_classes=BLOCKS, deepspeed=deepspeed)
    assert path.read_text() == (GOLDEN / name).read_text()


def test_notes_are_comments_and_the_rest_is_accelerates_yaml(tmp_path):
    plan = Plan(dp_replicate=2, dp_shard=8, zero=3)
    path = acc.export_accelerate_config(plan, TWO_NODES, tmp_path / "a.yaml", block_classes=BLOCKS)
    text = path.read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert any(plan.name in line for line in comments) and any("machine_rank" in line for line in comments)
    data = yaml.safe_load(text)
    assert data["main_process_ip"] == acc.MAIN_PROCESS_IP and data["machine_rank"] == 0
    assert data["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "TransformerBlock"


def test_cpu_ranks_run_ddp_through_torchrun(tmp_path):
    plan = Plan(dp_replicate=2, precision="fp32")
    path = acc.export_accelerate_config(plan, parse_cluster("2xcpu"), tmp_path / "a.yaml")
    assert "ACCELERATE_USE_CPU=1" in path.read_text()
    assert load_config_from_file(str(path)).use_cpu
    launcher, env = _launch_env(path)
    assert launcher == "torchrun" and "ACCELERATE_USE_FSDP" not in env


@pytest.mark.parametrize("plan, cluster, deepspeed, match", [
    (Plan(pp=2, dp_replicate=4, microbatches=2), ONE_NODE, False, "no pipeline parallelism"),
    (Plan(dp_shard=8, zero=1), ONE_NODE, False, "only through DeepSpeed"),
    (Plan(dp_shard=8, zero=2, offload="optimizer"), ONE_NODE, False, "optimizer-only CPU offload"),
    (Plan(dp_shard=8, zero=3, activation_checkpointing="selective"), ONE_NODE, False, "whole blocks"),
    (Plan(dp_shard=8, zero=3, activation_checkpointing="selective-op"), ONE_NODE, False, "selective-op .*whole blocks"),
    (Plan(dp_replicate=8, activation_checkpointing="full"), ONE_NODE, False, "through FSDP only"),
    (Plan(dp_shard=8, zero=3, precision="bf16-true"), ONE_NODE, False, "no bf16-true mode"),
    (Plan(tp=2, dp_shard=4, zero=3, sequence_parallel=True), ONE_NODE, False, "sequence parallelism"),
    (Plan(tp=2, dp_shard=4, zero=3), ONE_NODE, True, "tensor parallelism \\(not in DeepSpeed"),
    (Plan(dp_shard=2, zero=3, precision="fp32"), parse_cluster("2xcpu"), False, "only DDP on CPU"),
    (Plan(dp_replicate=4), ONE_NODE, False, "world size is 8"),
])
def test_what_accelerate_cannot_run_is_a_usage_error(plan, cluster, deepspeed, match):
    with pytest.raises(UsageError, match=match):
        acc.to_accelerate_config(plan, cluster, block_classes=BLOCKS, deepspeed=deepspeed)


def test_fsdp_needs_the_block_class():
    with pytest.raises(UsageError, match="HINT: pass block_classes"):
        acc.to_accelerate_config(Plan(dp_shard=8, zero=3), ONE_NODE)


@pytest.mark.parametrize("version, plan, match", [
    ("1.9.0", Plan(dp_replicate=2, dp_shard=4, zero=3), "(?s)ParallelismConfig.*accelerate>=1.10"),
    ("1.5.2", Plan(dp_shard=8, zero=2), "(?s)FSDP2.*accelerate>=1.6"),
])
def test_an_old_accelerate_is_told_what_to_upgrade(monkeypatch, version, plan, match):
    monkeypatch.setattr(acc, "accelerate_version", lambda: version)
    with pytest.raises(UsageError, match=match):
        acc.to_accelerate_config(plan, ONE_NODE, block_classes=BLOCKS)


def test_make_accelerator_in_one_process():
    try:
        accelerator = acc.make_accelerator(Plan(precision="fp32", grad_accum=3), cpu=True)
        assert accelerator.num_processes == 1 and accelerator.gradient_accumulation_steps == 3
        AcceleratorState._reset_state(reset_partial_state=True)
        with pytest.raises(UsageError, match="for 2 processes but Accelerate runs 1"):
            acc.make_accelerator(Plan(dp_replicate=2, precision="fp32"), cpu=True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_advise_emit_accelerate_writes_a_loadable_file(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2x4xA100:ib-hdr", "--global-batch-size", "32",
                 "--emit", "accelerate", "--output", str(path)]) == 0
    captured = capsys.readouterr()
    assert "Top plans" in captured.out and "target accelerate" in captured.out  # --emit picks the target
    assert f"to {path}" in captured.err
    config = load_config_from_file(str(path))
    assert config.num_processes == 8 and config.num_machines == 2
    if config.distributed_type.value == "FSDP":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block"  # from the profile


def test_advise_target_reports_what_it_leaves_out_and_the_cost(capsys):
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "2x4xA100:ib-hdr", "--global-batch-size", "32",
                 "--target", "accelerate", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any(reason.startswith("not runnable by accelerate") for reason in data["excluded"])
    overall = Plan.from_dict(data["overall"]["plan"])
    assert data["overall"]["tokens_per_second"] >= data["plans"][0]["tokens_per_second"]
    assert overall.world_size == 8


def test_the_cost_of_a_target_is_said_in_numbers():
    profile = profile_spec("gpt2-tiny")
    workload = Workload(global_batch_size=32, seq_len=profile.seq_len)
    cluster = parse_cluster("2x4xA100:ib-hdr")
    fast, slow = (evaluate(profile, cluster, workload, plan) for plan in (
        Plan(dp_shard=8, zero=2, micro_batch_size=4), Plan(dp_shard=8, zero=3, micro_batch_size=1, grad_accum=4,
                                                           activation_checkpointing="full")))
    line = explain_target_cost("accelerate", slow, fast)
    assert line.startswith("What accelerate leaves out costs") and fast.plan.name in line and "%" in line
    assert "costs nothing" in explain_target_cost("accelerate", fast, fast)
    assert explain_target_cost("accelerate", fast, None) is None
    assert explain_target_cost("accelerate", None, fast).startswith("Nothing accelerate can run fits")
