"""Combining per-node probes: pure cases, and one real all-gather between 2 gloo processes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from stratagem.distributed import free_port
from stratagem.advisor.hardware import Cluster, combine_clusters, gather_cluster, parse_cluster, probe_local
from stratagem.advisor.hardware.gather import LAUNCHER_NODE_RANKS, this_node
from stratagem.errors import UsageError


def test_without_a_process_group_the_local_cluster_comes_back():
    local = parse_cluster("8xH100")
    assert not dist.is_initialized()
    assert gather_cluster(local) is local


@pytest.mark.parametrize("variable", LAUNCHER_NODE_RANKS)
def test_a_launcher_s_node_rank_names_the_node(monkeypatch, variable):
    for name in LAUNCHER_NODE_RANKS:
        monkeypatch.delenv(name, raising=False)
    assert this_node() == socket.gethostname()
    monkeypatch.setenv(variable, "3")
    assert this_node() == "node 3"


def test_identical_nodes_combine():
    node = parse_cluster("8xH100:ib-ndr")
    combined = combine_clusters([(f"n{i // 8}", node) for i in range(32)])
    assert (combined.num_nodes, combined.world_size, combined.source) == (4, 32, "gather")
    assert combined.node == node.node and combined.notes == ()


def test_heterogeneous_nodes_plan_for_the_weakest():
    big, small = parse_cluster("2xH200:ib-ndr"), parse_cluster("2xH100:ib-hdr")
    combined = combine_clusters([("a", big), ("a", big), ("b", small), ("b", small)])
    assert combined.device.name == "H100-SXM5-80GB" and combined.network.name == "ib-hdr"
    notes = " | ".join(combined.notes)
    assert "nodes differ" in notes and "different networks" in notes


def test_uneven_ranks_per_node_is_a_usage_error():
    node = parse_cluster("8xH100:ib-ndr")
    with pytest.raises(UsageError, match=r"ranks per node differ: \{'a': 2, 'b': 1\}(.|\n)*HINT"):
        combine_clusters([("a", node), ("a", node), ("b", node)])


def test_gpu_nodes_running_fewer_ranks_than_gpus():
    combined = combine_clusters([("a", parse_cluster("8xH100")), ("a", parse_cluster("8xH100"))])
    assert combined.world_size == 2 and combined.node.link.domain_size == 2
    assert any("2 rank(s) per node on 8 device(s)" in note for note in combined.notes)


def test_cpu_nodes_on_one_host_split_it():
    """``torchrun --nnodes 2`` on one machine: two nodes of one rank each, sharing the host's
    cores and memory; on hosts of their own each rank has its host whole."""
    probe = parse_cluster("1xcpu")
    host = probe.node.host
    shared = combine_clusters([("node 0", probe), ("node 1", probe)], hosts=["h", "h"])
    assert (shared.num_nodes, shared.devices_per_node) == (2, 1)
    assert shared.device.num_cores == max(1, host.num_cores // 2)
    assert shared.device.memory_bytes == host.memory_bytes // 2
    assert any("2 ranks share each host" in note for note in shared.notes)
    apart = combine_clusters([("node 0", probe), ("node 1", probe)], hosts=["a", "b"])
    assert apart.device == probe.device and not any("share" in note for note in apart.notes)


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        same_host = gather_cluster(probe_local(sysfs_root=out_dir))
        net = "ib-ndr" if rank == 0 else "ib-hdr"
        two_nodes = gather_cluster(parse_cluster(f"8xH100:{net}"), node_key=f"node{rank}")
        result = {"same_host": same_host.to_dict(), "two_nodes": two_nodes.to_dict()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gather_between_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], "every rank must see the same cluster"
    same_host = Cluster.from_dict(results[0]["same_host"])
    assert (same_host.num_nodes, same_host.devices_per_node) == (1, 2)
    assert not same_host.is_gpu and same_host.node.link.kind == "loopback"
    two_nodes = Cluster.from_dict(results[0]["two_nodes"])
    # one rank per node: the job, not the hardware, sets the world size
    assert (two_nodes.num_nodes, two_nodes.world_size) == (2, 2)
    assert two_nodes.network.name == "ib-hdr" and two_nodes.device.name == "H100-SXM5-80GB"
    assert any("1 rank(s) per node on 8 device(s)" in note for note in two_nodes.notes)
