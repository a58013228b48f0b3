"""Launch a command as a torchrun job on this host: one agent, or one agent per "node" meeting at
a static rendezvous on the loopback, as a multi-node job's agents meet on their first node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spawn import free_port

TIMEOUT = 300
"""Seconds a job may run before the test fails."""


def torchrun(*args: str, cwd: Path, env: dict[str, str], nodes: int = 1,
             per_node: int = 2) -> list[subprocess.CompletedProcess]:
    """Run ``torchrun … args`` with ``nodes`` agents of ``per_node`` ranks each; what each agent
    printed and returned, node 0 first."""
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(per_node)]
    if nodes > 1:
        command += ["--nnodes", str(nodes), "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    logs = [(cwd / f"node{node}.out", cwd / f"node{node}.err") for node in range(nodes)]
    agents = []
    for node, (out, err) in enumerate(logs):  # files, not pipes: an agent never blocks on its output
        with out.open("w") as stdout, err.open("w") as stderr:
            agents.append(subprocess.Popen([*command, *(["--node-rank", str(node)] if nodes > 1 else []), *args],
                                           cwd=cwd, env=env, stdout=stdout, stderr=stderr))
    try:
        codes = [agent.wait(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()  # torchrun stops its workers on SIGTERM
                agent.wait(timeout=30)
    return [subprocess.CompletedProcess(agent.args, code, out.read_text(), err.read_text())
            for agent, code, (out, err) in zip(agents, codes, logs)]
