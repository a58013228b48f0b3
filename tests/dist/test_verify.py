"""``stratagem verify`` and ``advise --verify`` run plans on real gloo processes and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import torchrun

from stratagem.errors import UsageError
from stratagem.plan import Plan
from stratagem.advisor.profile.cache import profile_spec
from stratagem.advisor.cost.estimate import Estimate
from stratagem.verify import verify_estimates, verify_plan
from stratagem.verify.runner import MEMORY_STEPS

_TINY = ["--model", "llama-tiny", "--global-batch-size", "4", "--seq-len", "16", "--precision", "fp32"]


def _stratagem(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratagem", *args], capture_output=True, text=True, timeout=300,
                          env={**_env(tmp_path), **env}, cwd=tmp_path)


def test_verify_runs_the_best_plan_and_writes_it(tmp_path: Path) -> None:
    """…run twice, showing, with its output piped, each phase on stderr as it starts and ends and each
    step as it ends."""
    done = _stratagem("verify", *_TINY, "--nproc", "2", "--top", "1", "--steps", "2", "--repeats", "2",
                      "--output", str(tmp_path / "plan.json"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "predicted vs measured" in done.stdout and "verify [1/1] run 2/2" in done.stderr
    assert "over 2 steps × 2 runs per plan" in " ".join(done.stdout.split())
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.world_size == 2 and f"measured winner: {plan.name}" in done.stdout
    lines = done.stderr.splitlines()
    for phase in ("profile: llama-tiny", "search: plans for 1x2xcpu", "spawn: 2 ranks", "build: model, plan"):
        assert f"{phase}" in done.stderr and any(line.startswith(phase) and "(done in " in line for line in lines)
    steps = [line for line in lines if line.startswith(("warm-up: step", "measured: step"))]
    warm = MEMORY_STEPS + 1  # the steps the peak is read over, and one more
    assert [line.split(":")[1] for line in steps] == ([f" step {i}/{warm}" for i in range(1, warm + 1)]
                                                      + [" step 1/2", " step 2/2"]) * 2
    last_step = max(i for i, line in enumerate(lines) if line.startswith(("warm-up: step", "measured: step")))
    assert last_step < next(i for i, line in enumerate(lines) if line.startswith("verify [1/1] run 2/2"))
    assert "spawn:" not in done.stdout  # stdout keeps the results


_TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


def _mlp(batch_size: int = 2) -> tuple:
    return torch.nn.Linear(4, 4), (torch.randn(batch_size, 4),)


def _with_factories(tmp_path: Path) -> dict[str, str]:
    """The environment of a run that names 'model_factories:…' (tests/unit), importable in its ranks too."""
    factories = str(Path(__file__).parents[1] / "unit")
    return {**_env(tmp_path), "PYTHONPATH": os.pathsep.join([factories, os.environ.get("PYTHONPATH", "")])}


def test_verify_trains_a_factory_s_model_on_its_example_inputs_with_its_loss(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "stratagem", "verify", "--model", "model_factories:mlp_with_targets",
                           "--nproc", "2", "--global-batch-size", "4", "--precision", "fp32", "--top", "1",
                           "--steps", "1"], capture_output=True, text=True, timeout=300, env=_with_factories(tmp_path),
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "predicted vs measured" in done.stdout and "measured winner" in done.stdout
    assert "measured: step 1/1" in done.stderr and "s/step" in done.stderr


def test_verify_trains_an_hf_config_with_random_weights_and_its_own_loss(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    done = _stratagem("verify", "--model", f"hf:{tmp_path}", "--nproc", "2", "--global-batch-size", "4",
                      "--seq-len", "16", "--precision", "fp32", "--top", "1", "--steps", "1", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "predicted vs measured" in done.stdout and "measured winner" in done.stdout
    assert "measured: step 1/1" in done.stderr and "s/step" in done.stderr


def test_a_factory_the_spawned_ranks_cannot_import_is_a_usage_error(monkeypatch) -> None:
    """A module that lives only in this process (made here, no file): its ranks cannot import it."""
    import types

    ghost = types.ModuleType("ghost_factories")
    ghost.mlp = _mlp
    monkeypatch.setitem(sys.modules, "ghost_factories", ghost)
    with pytest.raises(UsageError, match="spawned rank could not load the model: cannot load factory") as raised:
        verify_plan("ghost_factories:mlp", Plan(micro_batch_size=2, precision="fp32"), seq_len=None,
                    optimizer="adamw", steps=1, timeout=120)
    assert "importable there" in str(raised.value)


def _bad_and_good() -> list[Estimate]:
    """A plan that fails on every rank (its blocks are not in the model), then one that runs."""
    good = Plan(dp_replicate=2, micro_batch_size=2, precision="fp32")
    bad = Plan(dp_shard=2, zero=3, micro_batch_size=2, precision="fp32", tp=1,
               activation_checkpointing="full", block_container="no.such.blocks")
    return [_estimate(bad), _estimate(good)]


def test_a_failing_plan_is_reported_and_the_others_go_on(tmp_path: Path) -> None:
    results = verify_estimates("llama-tiny", _bad_and_good(), seq_len=16, optimizer="adamw", steps=1, timeout=120)
    assert results[0].measured is None and "no.such.blocks" in results[0].error
    assert results[1].measured is not None and results[1].measured.step_seconds > 0
    assert results[1].measured.peak_bytes > 0


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "STRATAGEM_CACHE_DIR": str(tmp_path)}


def test_verify_in_a_launched_job_runs_the_plans_on_the_job_s_ranks(tmp_path: Path) -> None:
    """Under torchrun every rank takes part: the job's cluster is advised for, each plan runs in
    processes of its own (one per rank), and rank 0 alone reports."""
    (done,) = torchrun("-m", "stratagem", "verify", *_TINY, "--top", "1", "--steps", "2",
                       "--output", str(tmp_path / "plan.json"), cwd=tmp_path, env=_env(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("predicted vs measured") == 1 and done.stderr.count("verify [1/1]") == 1
    assert Plan.from_json((tmp_path / "plan.json").read_text()).world_size == 2


def test_verify_in_a_two_node_job_runs_each_plan_across_the_nodes(tmp_path: Path) -> None:
    """Two torchrun agents, one rank each, as two nodes launch: the cluster advised for has two
    nodes, each rank's process joins the plan's group at rank 0's node, and node 0 reports."""
    first, second = torchrun("-m", "stratagem", "verify", *_TINY, "--top", "2", "--steps", "1",
                             cwd=tmp_path, env=_env(tmp_path), nodes=2, per_node=1)
    assert first.returncode == second.returncode == 0, first.stderr[-3000:] + second.stderr[-3000:]
    assert "measured on 2x1xcpu" in " ".join(first.stdout.split()) and "measured winner" in first.stdout
    assert first.stderr.count("s/step") == 2 and second.stdout == ""


_JOB_SCRIPT = """
import json
import os
import torch.distributed as dist
import stratagem.verify.verify as verify
from test_verify import _bad_and_good, _lopsided

if __name__ == "__mp_main__" and os.environ["RANK"] == "1":  # rank 1's plan processes
    measure = verify.measure_plan

    def measure_or_fail(model, plan, **kwargs):
        if plan == _lopsided().plan:
            raise RuntimeError("rank 1 alone fails")
        return measure(model, plan, **kwargs)

    verify.measure_plan = measure_or_fail

if __name__ == "__main__":  # the plans' spawned processes import this module again
    dist.init_process_group("gloo")
    bad, good = _bad_and_good()
    results = verify.verify_estimates("llama-tiny", [bad, _lopsided(), good], seq_len=16, optimizer="adamw", steps=1,
                                      timeout=120)
    if dist.get_rank() == 0:
        print(json.dumps([[r.error, r.measured and r.measured.step_seconds] for r in results]))
    dist.destroy_process_group()
"""


def _lopsided() -> Estimate:
    """A plan the job script makes fail on rank 1 alone (rank 0 then loses its peer)."""
    return _estimate(Plan(dp_replicate=2, micro_batch_size=1, grad_accum=2, precision="fp32"))


def test_failing_plans_in_a_launched_job_leave_the_job_able_to_run_the_next(tmp_path: Path) -> None:
    """A plan that fails on every rank, then one that fails on rank 1 alone (reported with rank 1's
    error, the cause, not rank 0's lost connection), then one that runs."""
    (tmp_path / "job.py").write_text(_JOB_SCRIPT)
    env_path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    (done,) = torchrun("job.py", cwd=tmp_path, env={**_env(tmp_path), "PYTHONPATH": env_path})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (bad_error, bad_step), (lopsided_error, lopsided_step), (good_error, good_step) = json.loads(
        done.stdout.strip().splitlines()[-1])
    assert "no.such.blocks" in bad_error and bad_step is None
    assert "rank 1 alone fails" in lopsided_error and lopsided_step is None
    assert good_error is None and good_step > 0


def test_advise_verify_needs_this_host(tmp_path: Path) -> None:
    done = _stratagem("advise", *_TINY, "--cluster", "2x8xH100:ib-ndr", "--verify", "1", tmp_path=tmp_path)
    assert done.returncode == 2 and "verify runs plans on this host" in done.stderr


def test_advise_verify_in_a_launched_job_points_to_verify(tmp_path: Path) -> None:
    done = _stratagem("advise", *_TINY, "--cluster", "2xcpu", "--verify", "1", tmp_path=tmp_path, RANK="0",
                      WORLD_SIZE="2")
    assert done.returncode == 2 and "-m stratagem verify" in done.stderr and "Traceback" not in done.stderr


def _estimate(plan: Plan) -> Estimate:
    from stratagem.advisor.cost.evaluate import evaluate
    from stratagem.advisor.hardware import Cluster, parse_cluster
    from stratagem.plan import Workload
    from stratagem.advisor.profile.cache import profile_spec

    profile = profile_spec("llama-tiny", seq_len=16, precision="fp32")
    workload = Workload(global_batch_size=plan.global_batch_size, seq_len=16, precision="fp32")
    return evaluate(profile, parse_cluster("2xcpu"), workload, plan)


class _Breaking(torch.nn.Module):
    """A block whose forward torch.compile cannot take in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


class _BreakingStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Breaking(), _Breaking()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def graph_breaking(batch_size: int = 2):
    """A factory (``test_verify:graph_breaking``): the stack and its example input."""
    return _BreakingStack(), (torch.randn(batch_size, 8),)


def test_a_compiled_plan_reports_the_graph_breaks_in_its_blocks() -> None:
    """No silent fallback: blocks torch.compile splits into graphs are counted on the ranks and
    reported, with the first reason."""
    measured = verify_plan("test_verify:graph_breaking", Plan(micro_batch_size=2, precision="fp32", compile=True,
                                                              block_container="layers"),
                           seq_len=None, optimizer="adamw", steps=1, timeout=240)
    assert measured.graph_breaks >= 2 and "graph_break" in measured.graph_break


def two_wide_layers(batch_size: int = 4):
    """A factory (``test_verify:two_wide_layers``): two 16 MiB Linears, one per pipeline stage."""
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)), (torch.randn(batch_size, 2048),)


def test_a_pipeline_rank_is_measured_holding_its_own_stage() -> None:
    """verify builds the whole model on every rank before splitting it; a rank's measured peak is
    what its stage holds (its Linear, gradient and SGD's momentum, and the second micro-batch's
    weight gradient before it is added to the first's: 64 MiB), not the other stage's Linear as
    well (80 MiB while the runner kept the whole model)."""
    plan = Plan(pp=2, microbatches=2, micro_batch_size=2, precision="fp32", block_container="")
    measured = verify_plan("test_verify:two_wide_layers", plan, seq_len=None, optimizer="sgd", steps=1, timeout=240)
    assert measured.peak_bytes < 72 * 2**20, measured.peak_bytes / 2**20


@pytest.mark.parametrize("how", ["norm", "value"])
def test_a_pipeline_clips_over_its_stages_where_the_workload_clips(how: str) -> None:
    """``grad_clip`` on the ranks verify spawns: each step clips before the optimizer, by the norm
    over both stages (``Pipeline.clip_grad_norm_``) or each stage's by value, and is measured
    (the unit test counts the calls of the data-parallel path; here the pipeline's must run)."""
    plan = Plan(pp=2, microbatches=2, micro_batch_size=2, precision="fp32", block_container="")
    measured = verify_plan("test_verify:two_wide_layers", plan, seq_len=None, optimizer="sgd", grad_clip=how,
                           steps=1, timeout=240)
    assert measured.step_seconds > 0


def test_a_tied_hugging_face_decoder_is_verified_as_a_pipeline_built_on_meta(tmp_path: Path) -> None:
    """A Qwen2 that ties its head to its embedding, as a pipeline: each stage is built on
    meta and initialised on its own, and transformers' own initialisation, which ties weights, must
    not look for the half of the pair the stage does not hold (it did, and the run failed; that the
    Pipeline keeps the copies equal, test_pipeline.py checks)."""
    config = {**_TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = Plan(pp=2, microbatches=2, micro_batch_size=2, precision="fp32", block_container="model.layers")
    measured = verify_plan(f"hf:{tmp_path}", plan, seq_len=16, optimizer="adamw", steps=1, timeout=240)
    assert measured.step_seconds > 0 and measured.peak_bytes > 0


def test_a_hugging_face_model_s_own_loss_runs_on_the_logits_vocabulary_shards(tmp_path: Path) -> None:
    """verify trains an ``hf:`` model with its own loss (labels in its forward), so the profile's
    layout runs it on the logits' shards (``vocab_loss``): the runner enters torch's
    ``loss_parallel`` around it, and the loss transformers computes (shifted labels, the padding
    ignored) runs on the shards."""
    (tmp_path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    profile = profile_spec(f"hf:{tmp_path}", seq_len=16, precision="fp32", kernels="cpu")
    assert dict(profile.tp_layout)["lm_head"] == "vocab_loss"
    plan = Plan(tp=2, micro_batch_size=2, precision="fp32", block_container=profile.block_container,
                tp_layout=profile.tp_layout)
    measured = verify_plan(f"hf:{tmp_path}", plan, seq_len=16, optimizer="adamw", steps=1, timeout=240)
    assert measured.step_seconds > 0 and measured.peak_bytes > 0


def wide_activations(batch_size: int = 2048):
    """A factory (``test_verify:wide_activations``): a 16 MiB Linear and four Tanh, each saving its
    16 MiB output for backward."""
    layers = [torch.nn.Linear(2048, 2048)] + [torch.nn.Tanh() for _ in range(4)]
    return torch.nn.Sequential(*layers), (torch.randn(batch_size, 2048),)


def test_a_ddp_rank_is_measured_beside_its_gradient_buckets() -> None:
    """DDP rebuilds its gradient buckets as the second forward starts, and on CPU their pages count
    once written: the peak, as backward starts here, is measured into the steady state, where the
    buckets (a copy of the gradients, 16 MiB) stand beside the activations one process holds
    (measured over two steps, the DDP rank's peak came out below one process's)."""
    single = Plan(micro_batch_size=2048, precision="fp32", block_container="")
    plans = (single, Plan.from_dict({**single.to_dict(), "dp_replicate": 2}))
    alone, ddp = (verify_plan("test_verify:wide_activations", plan, seq_len=None, optimizer="adamw", steps=1,
                              timeout=240) for plan in plans)
    assert ddp.peak_bytes - alone.peak_bytes > 10 * 2**20, (alone.peak_bytes / 2**20, ddp.peak_bytes / 2**20)
