"""How fast `advise` answers: plans costed per second, and the command's wall time end to end.

    .venv/bin/python bench/advise_speed.py

1. Runs the command of issue 3 in fresh processes, as a user would, with a fresh profile
   cache: cold (it profiles the model: torch and its fake-tensor machinery load) and warm
   (the profile comes from the cache: torch is not imported), reporting wall times (imports,
   profiling and search included), the plans costed and the search time.
2. In this process, profiles once and times the search alone (best of 3, since this machine
   is noisy) to report plans costed per second.
Targets (issue 3): >= 20,000 plans/s and <= 3 s end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stratagem.advisor.profile.cache import CACHE_ENV

ARGS = ["--model", "llama-2-70b", "--cluster", "128x8xH100-SXM-80GB:ib-ndr",
        "--global-batch-size", "1024", "--seq-len", "4096"]


def end_to_end() -> None:
    advise = Path(sys.executable).with_name("advise")
    print(f"advise {' '.join(ARGS)} --json")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, CACHE_ENV: cache}
        for label in ("cold (profiles)", "warm (cached profile)"):
            started = time.perf_counter()
            out = subprocess.run([str(advise), *ARGS, "--json"], capture_output=True, text=True,
                                 check=True, env=env).stdout
            wall = time.perf_counter() - started
            doc = json.loads(out)
            print(f"  {label:<22} wall time {wall:5.2f} s end to end; {doc['num_evaluated']:,} plans "
                  f"costed in {doc['search_seconds']:.2f} s; best: {doc['plans'][0]['name']}")


def search_only() -> None:
    from stratagem.advisor.hardware import parse_cluster
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.plan import Workload
    from stratagem.advisor.search.advice import advise

    profile = profile_spec("llama-2-70b", seq_len=4096, cache=False)
    cluster = parse_cluster("128x8xH100-SXM-80GB:ib-ndr")
    workload = Workload(global_batch_size=1024, seq_len=4096)
    runs = [advise(profile, cluster, workload) for _ in range(3)]
    best = min(runs, key=lambda a: a.search_seconds)
    print(f"search alone: {best.num_evaluated:,} plans in {best.search_seconds:.3f} s = "
          f"{best.num_evaluated / best.search_seconds:,.0f} plans/s (best of 3; "
          f"runs: {', '.join(f'{a.search_seconds:.3f}' for a in runs)} s)")


if __name__ == "__main__":
    end_to_end()
    search_only()
