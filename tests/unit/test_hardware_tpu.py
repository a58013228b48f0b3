"""Cloud TPU chips in the catalog: specs parse to one ICI slice, advice runs on them with a note
that torch_xla applies the plan, and what runs plans with torch.distributed refuses them."""

from __future__ import annotations

import json

import pytest

from stratagem.advisor.cost import rates
from stratagem.advisor.hardware import Cluster, catalog, parse_cluster
from stratagem.cli import main
from stratagem.errors import UsageError


def test_every_tpu_figure_has_a_source_and_every_name_is_unique():
    figures = ("memory", "memory_bandwidth", "bf16", "fp32", "ici", "max_slice")
    for entry in catalog.TPUS:
        for field in figures:
            fig = getattr(entry, field)
            assert fig.value > 0 and fig.source, (entry.name, field)
        assert entry.fp32.estimate and entry.host_link in catalog.LINKS
    names = [alias.upper() for e in (*catalog.GPUS, *catalog.TPUS) for alias in (e.name, *e.aliases)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("spec", "name", "chips", "ici"), [
    ("4xTPU-v5e", "TPU-v5e", 4, 200e9),
    ("16xv5p", "TPU-v5p", 16, 600e9),
    ("8xv5litepod", "TPU-v5e", 8, 200e9),
    ("256xTrillium", "TPU-v6e", 256, 400e9),
    ("4xv4", "TPU-v4", 4, 1.1e15 / 4096),
])
def test_a_tpu_spec_is_one_slice_over_ici(spec, name, chips, ici):
    cluster = parse_cluster(spec)
    assert (cluster.device.name, cluster.world_size, cluster.num_nodes) == (name, chips, 1)
    assert cluster.device.kind == "tpu" and cluster.is_tpu and cluster.is_accelerator and not cluster.is_gpu
    assert cluster.backend == "xla" and cluster.network is None
    assert cluster.node.link.kind == "ici" and cluster.node.link.bandwidth == pytest.approx(ici)
    assert cluster.node.link.domain_size == chips and cluster.node.link.topology.endswith("torus")
    assert any("torch_xla" in note for note in cluster.notes)
    assert Cluster.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster


def test_tpu_figures_as_the_cloud_docs_give_them():
    v5e, v5p = parse_cluster("v5e").device, parse_cluster("v5p").device
    assert (v5e.memory_bytes, v5e.memory_bandwidth, v5e.peak_bf16) == (16 * 2**30, 819e9, 197e12)
    assert (v5p.memory_bytes, v5p.memory_bandwidth, v5p.peak_bf16) == (95 * 2**30, 2765e9, 459e12)
    assert v5e.peak_fp16 is None and v5e.peak_tf32 is None and "peak_fp32" in v5e.estimated
    with pytest.raises(UsageError, match="(?s)TPU-v5e has no fp16 math.*HINT: .*bf16-mixed instead of fp16-mixed"):
        v5e.peak_flops("fp16")


def test_gpus_and_cpu_ranks_keep_their_kind():
    h100, cpu = parse_cluster("8xH100"), parse_cluster("2xcpu")
    assert h100.is_gpu and h100.is_accelerator and not h100.is_tpu and h100.backend == "nccl"
    assert not cpu.is_gpu and not cpu.is_accelerator and not cpu.is_tpu and cpu.backend == "gloo"
    # a TPU's GEMMs run at the accelerators' flat fraction: the shape model needs SMs (GPUs')
    assert rates.achievable_fraction(parse_cluster("8xv5e"), [], "bf16") == rates.ACHIEVABLE_FLOPS_FRACTION["gpu"]


@pytest.mark.parametrize(("spec", "message"), [
    ("2x8xv5e:eth-100", "(?s)one slice of chips joined by ICI.*HINT: describe one slice, e.g. '16xTPU-v5e'"),
    ("8xv5e:ib-ndr", "(?s)Multislice.*HINT:"),
    ("8xv5e+bridge", "(?s)'\\+bridge'.*HINT:"),
    ("512xv5e", "(?s)slice of 512 TPU-v5e chips, more than the largest.*256 chips.*HINT: at most '256xTPU-v5e'"),
])
def test_what_a_tpu_slice_cannot_be(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_cluster(spec)


def test_hardware_shows_a_tpu_slice(capsys):
    assert main(["hardware", "--cluster", "8xTPU-v5e"]) == 0
    out = capsys.readouterr().out
    for text in ("TPU-v5e (tpu, google)", "197.0 TFLOP/s", "ici 2d-torus", "(xla)", "torch_xla"):
        assert text in out


def test_advise_on_tpus_says_torch_xla_applies_the_plan(capsys):
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", "4xTPU-v5e", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["node"]["device"]["kind"] == "tpu" and data["plans"]
    assert any("torch_xla" in note for note in data["notes"])


@pytest.mark.parametrize(("cluster", "noun"), [("4xTPU-v5e", "TPU chip"), ("2xcpu", "rank"), ("2xA100", "GPU")])
def test_the_report_names_what_a_rank_runs_on(capsys, cluster, noun):
    """Every report had said "per GPU", TPU slices and CPU ranks too."""
    assert main(["advise", "--model", "gpt2-tiny", "--cluster", cluster, "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"memory / {noun}" in out and f"Memory per {noun}" in out
    assert noun == "GPU" or not ("per GPU" in out or "/ GPU" in out)


@pytest.mark.parametrize("extra", [["--emit", "accelerate"], ["--emit", "deepspeed"], ["--emit", "lightning"],
                                   ["--verify", "1"]])
def test_emit_and_verify_refuse_a_tpu_cluster(extra, capsys, tmp_path):
    argv = ["advise", "--model", "gpt2-tiny", "--cluster", "4xv5e", "--output", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "torch_xla" in err and "HINT:" in err and not (tmp_path / "out").exists()


def test_integrations_refuse_a_tpu_cluster(tmp_path):
    from stratagem.integrations.accelerate import to_accelerate_config
    from stratagem.integrations.lightning_config import export_lightning_config
    from stratagem.plan import Plan

    cluster, plan = parse_cluster("4xv5e"), Plan(dp_replicate=4)
    with pytest.raises(UsageError, match="(?s)the Accelerate config.*torch_xla.*HINT:"):
        to_accelerate_config(plan, cluster)
    with pytest.raises(UsageError, match="(?s)the Lightning config.*torch_xla.*HINT:"):
        export_lightning_config(plan, cluster, tmp_path / "trainer.yaml")


def test_nothing_fits_on_a_slice_suggests_a_larger_slice(capsys):
    assert main(["advise", "--model", "llama-2-70b", "--cluster", "4xv5e", "--format", "markdown"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "4 TPU chips" in out and "a slice of 32 TPU-v5e chips" in out and "GPUs" not in out.split("Notes")[0]
