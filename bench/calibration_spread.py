"""How far the calibration's own noise moves the advisor's CPU predictions, on this host.

    .venv/bin/python bench/calibration_spread.py [--calibrations 3] [--nproc 4]

Runs ``stratagem calibrate`` several times, as ``bench/accuracy.py``'s passes do (``nproc`` gloo
ranks, the full settings), and prints what each measured of the collectives: the all-reduce's α
and β over every rank and over pairs, and the wait after compute. Then costs accuracy.py's cases
under each calibration and prints every case's predicted step per calibration and its spread
(the largest over the smallest, less one), and the largest spread of the tensor-parallel plans
and of the others. Nothing is measured against a run: accuracy.py does that.
"""

from __future__ import annotations

import argparse
import time

from stratagem.advisor.calibrate.run import calibrate
from stratagem.advisor.hardware import parse_cluster
from stratagem.units import format_bytes, format_seconds

from accuracy import _estimate, cases  # bench/accuracy.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrations", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    started, clusters = time.perf_counter(), []
    for i in range(args.calibrations):
        calibration = calibrate(nproc=args.nproc)
        intra = calibration.links["intra"]["all_reduce"]
        links = ", ".join(f"×{size} α {format_seconds(fit.latency)} β {format_bytes(fit.bandwidth)}/s"
                          for size, fit in sorted(intra.items()))
        waits = ", ".join(f"×{size} {format_seconds(wait)}"
                          for size, wait in sorted((calibration.sync_seconds or {}).items()))
        print(f"calibration {i + 1} ({calibration.seconds:.0f} s): all-reduce {links}; wait after compute "
              f"{waits or 'none'}", flush=True)
        clusters.append(calibration.apply(parse_cluster(f"{args.nproc}xcpu")))
    worst = {True: 0.0, False: 0.0}
    for case in cases(args.nproc, "small"):
        steps = [_estimate(case, cluster, "small").time.step_seconds for cluster in clusters]
        spread = max(steps) / min(steps) - 1
        worst[case.plan.tp > 1] = max(worst[case.plan.tp > 1], spread)
        print(f"{case.model:<14} {case.plan.name:<40} {' '.join(f'{format_seconds(s):>8}' for s in steps)}"
              f"  spread {spread:5.1%}")
    print(f"largest spread: tensor-parallel plans {worst[True]:.1%}, the others {worst[False]:.1%}; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
