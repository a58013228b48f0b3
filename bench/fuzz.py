"""A larger corpus of generated inputs than the test suite's, with the outcomes counted.

    .venv/bin/python bench/fuzz.py [--examples 3000]

Each family (plan dicts, plan files' text, cluster specs, command-line numbers, Hugging Face
configs, batch sizes the search must answer) gets ``--examples`` generated inputs from ``tests/unit/fuzz_inputs.py``; each
input ends in a usage error, a valid result or a traceback (printed, the first few of each kind),
timed. Target: 0 tracebacks, no case near a hang (the slowest is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # a config's own warnings are not outcomes

from fuzz_inputs import CRASH, HF_CONFIGS, NUMBER_TEXTS, classify, cluster_specs, plan_dicts, plan_texts  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from stratagem.advisor.hardware import parse_cluster  # noqa: E402
from stratagem.advisor.profile.cache import profile_spec  # noqa: E402
from stratagem.advisor.profile.hf_configs import build_hf_config, check_hf_config  # noqa: E402
from stratagem.advisor.search.advice import advise  # noqa: E402
from stratagem.cli import build_parser  # noqa: E402
from stratagem.errors import UsageError  # noqa: E402
from stratagem.integrations.planning import load_plan  # noqa: E402
from stratagem.plan import Plan, Workload  # noqa: E402

SHOWN_TRACEBACKS = 3


def _parse_numbers(batch: str, seq: str) -> None:
    """The command line's reading of two numbers; argparse's refusal (exit 2) counts as a usage error."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["advise", "--model", "llama-tiny", "--global-batch-size", batch,
                                       "--seq-len", seq])
    except SystemExit as exit:
        if exit.code != 2:
            raise
        raise UsageError("argparse refused it") from None


def _check_and_build(config: dict) -> None:
    """A generated ``hf:`` config through the checks and, where they pass, transformers' reading."""
    check_hf_config(config, "generated/config.json")
    build_hf_config(config, "generated/config.json")


def _families(examples: int) -> dict[str, tuple[st.SearchStrategy, Callable, int]]:
    tiny = profile_spec("llama-tiny", seq_len=16)
    batches = st.tuples(st.one_of(st.integers(1, 10**6), st.integers(1, 2**31)),
                        st.sampled_from(["2xcpu", "8xH100", "2x8xH100:ib-ndr", "1xL4"]))
    return {
        "plan dicts": (plan_dicts(), load_plan, examples),
        "plan text": (plan_texts(), Plan.from_json, examples),
        "cluster specs": (cluster_specs(), parse_cluster, examples),
        "numbers": (st.tuples(NUMBER_TEXTS, NUMBER_TEXTS), lambda pair: _parse_numbers(*pair), examples),
        "hf configs": (HF_CONFIGS, _check_and_build, examples),
        "batch sizes": (batches, lambda case: advise(tiny, parse_cluster(case[1]),
                                                     Workload(global_batch_size=case[0], seq_len=16), top=1),
                        max(1, examples // 20)),
    }


def run_family(name: str, strategy: st.SearchStrategy, target: Callable, count: int) -> Counter:
    outcomes: Counter = Counter()
    slowest = [0.0, None]

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def case(value):
        started = time.perf_counter()
        try:
            outcome = classify(lambda: target(value))
        except Exception:
            outcome = CRASH
            if outcomes[CRASH] < SHOWN_TRACEBACKS:
                print(f"--- {name}: {value!r:.200}\n{traceback.format_exc()}", file=sys.stderr)
        outcomes[outcome] += 1
        seconds = time.perf_counter() - started
        if seconds > slowest[0]:
            slowest[:] = [seconds, value]

    case()
    print(f"{name:14} {sum(outcomes.values()):6,} cases: " + ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items()))
          + f"; slowest {slowest[0]:.2f} s ({slowest[1]!r:.60})")
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000, help="inputs per family (default: 3000)")
    args = parser.parse_args()
    total: Counter = Counter()
    for name, (strategy, target, count) in _families(args.examples).items():
        total += run_family(name, strategy, target, count)
    print(f"{'all':14} {sum(total.values()):6,} cases: " + ", ".join(f"{k} {v:,}" for k, v in sorted(total.items())))
    return 1 if total[CRASH] else 0


if __name__ == "__main__":
    sys.exit(main())
