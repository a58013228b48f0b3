"""How long profiling a large model takes here, and how much memory it needs.

Each model is profiled in a fresh process (batch 1, seq 4096, bf16-mixed, no cache) so that its
peak RSS is its own. Prints the wall time of building the model on meta plus profiling it, the
profiler's own time, the process's total wall time (imports of torch and torch._dynamo, which
fake tensors need, included) and its peak RSS.
Targets (issue 2): under 5 s and under 1.5 GB per model.

    .venv/bin/python bench/profile_speed.py [MODEL ...]
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
import time

DEFAULT_MODELS = ("llama-2-70b", "mixtral-8x7b")


def _child(model: str) -> None:
    started = time.perf_counter()
    # FakeTensorMode imports torch._dynamo on first use: count it with the imports.
    for module in ("torch._dynamo", "stratagem.advisor.profile.profiler"):
        importlib.import_module(module)
    from stratagem.advisor.profile.cache import profile_spec

    imported = time.perf_counter()
    profile = profile_spec(model, batch_size=1, seq_len=4096, precision="bf16-mixed", cache=False)
    done = time.perf_counter()
    print(json.dumps({
        "model": model,
        "parameters": profile.num_params,
        "tflops_per_step": profile.flops_per_step / 1e12,
        "build_and_profile_s": done - imported,
        "profile_s": profile.profile_seconds,
        "process_s": done - started,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }))


def main(models: list[str]) -> None:
    print(f"{'model':<14} {'params':>15} {'TFLOP/step':>11} {'build+profile':>14} {'profile':>8} "
          f"{'with imports':>13} {'peak RSS':>9}")
    for model in models:
        out = subprocess.run([sys.executable, __file__, "--child", model], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{r['model']:<14} {r['parameters']:>15,} {r['tflops_per_step']:>11.1f} "
              f"{r['build_and_profile_s']:>12.2f} s {r['profile_s']:>6.2f} s {r['process_s']:>11.2f} s "
              f"{r['peak_rss_gib']:>5.2f} GiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2])
    else:
        main(sys.argv[1:] or list(DEFAULT_MODELS))
