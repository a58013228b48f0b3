"""``stratagem hardware``: JSON, the table, and a bad spec."""

from __future__ import annotations

import json

from rich.console import Console

from stratagem.advisor.calibrate.calibration import calibrated
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.cli import main
from stratagem.cli.hardware_cmd import cluster_table

from calibrations import bare_calibration


def _table_text(cluster: Cluster) -> str:
    console = Console(width=200, record=True)
    console.print(cluster_table(cluster))
    return console.export_text()


def test_json_of_a_named_cluster(capsys):
    assert main(["hardware", "--cluster", "2x8xH100:ib-ndr", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 16 and data["spec"] == "2x8xH100-SXM5-80GB:ib-ndr-x8"
    assert Cluster.from_dict(data) == calibrated(parse_cluster("2x8xH100:ib-ndr"))  # the catalog's, noted


def test_table_of_a_named_cluster(capsys):
    assert main(["hardware", "--cluster", "2x4xL4:eth-100"]) == 0
    out = capsys.readouterr().out
    for text in ("L4", "121.0 TFLOP/s", "pcie-gen4", "eth-100", "8 rank(s)"):
        assert text in out
    assert "memory latency" not in out  # not catalogued for the L4


def test_table_shows_a_catalogued_memory_latency(capsys):
    assert main(["hardware", "--cluster", "1xH100"]) == 0
    assert "390 ns" in capsys.readouterr().out


def test_table_shows_the_rate_the_cost_model_gives_a_steps_largest_gemms(capsys):
    assert main(["hardware", "--cluster", "1xH100"]) == 0
    assert "697.0 TFLOP/s (70% of the peak" in capsys.readouterr().out  # the best shape's 792.1 × 0.88
    assert main(["hardware", "--cluster", "1xL4"]) == 0
    assert "~85.2 TFLOP/s (70% of the peak" in capsys.readouterr().out  # none catalogued: LARGE_GEMM_FRACTION
    h100 = parse_cluster("1xH100")
    measured = bare_calibration(matmul={"bf16": ((4096, 650e12), (8192, 700e12))}).apply(h100)
    # the curve's largest rate, not discounted again
    assert "700.0 TFLOP/s (measured by stratagem calibrate)" in _table_text(measured)
    assert "large GEMMs" not in _table_text(parse_cluster("8xv5e"))  # no shape model on TPUs


def test_local_probe_prints_notes(capsys):
    assert main(["hardware"]) == 0
    assert "note" in capsys.readouterr().out


def test_bad_spec_exits_2_with_the_reason(capsys):
    assert main(["hardware", "--cluster", "4xH900"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'H900'" in err and "HINT:" in err
