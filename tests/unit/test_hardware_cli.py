"""``stratagem hardware``: JSON, the table, and a bad spec."""

from __future__ import annotations

import json

from stratagem.advisor.calibrate.calibration import calibrated
from stratagem.advisor.hardware import Cluster, parse_cluster
from stratagem.cli import main


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


def test_table_shows_the_rate_a_steps_large_gemms_sustain_where_catalogued(capsys):
    assert main(["hardware", "--cluster", "1xH100"]) == 0
    assert "697.0 TFLOP/s (70% of the peak" in capsys.readouterr().out  # the best shape's 792.1 × 0.88
    assert main(["hardware", "--cluster", "1xL4"]) == 0
    assert "large GEMMs" not in capsys.readouterr().out  # none catalogued for the L4


def test_local_probe_prints_notes(capsys):
    assert main(["hardware"]) == 0
    assert "note" in capsys.readouterr().out


def test_bad_spec_exits_2_with_the_reason(capsys):
    assert main(["hardware", "--cluster", "4xH900"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'H900'" in err and "HINT:" in err
