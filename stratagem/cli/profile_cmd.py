"""``stratagem profile MODEL``: what one training step of the model costs, block by block."""

from __future__ import annotations

import argparse
import json

from stratagem.cli.common import PRECISION_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand."""
    parser = subparsers.add_parser(
        "profile",
        help="per-block parameters, FLOPs and activation bytes of one training step",
        description="Profile one training step of MODEL on fake tensors (nothing is allocated). "
        "MODEL is a preset name (e.g. llama-2-7b), 'pkg.module:factory' or 'hf:PATH/config.json'.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per step (default: 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (sequence models)")
    parser.add_argument("--precision", default="bf16-mixed",
                        help=f"{PRECISION_NAMES} (default: bf16-mixed)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="measure again instead of reading a cached profile")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Profile and print; returns the exit status."""
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.errors import UsageError
    from stratagem.plan.checks import MAX_SAMPLES

    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and not 1 <= value <= MAX_SAMPLES:
            raise UsageError(f"{name} must be at least 1 and at most {MAX_SAMPLES:,} (a 32-bit count, so that a "
                             f"step's tokens are a 64-bit index), got {value}")
    profile = profile_spec(args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                           precision=args.precision, cache=args.cache)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
    else:
        from rich.console import Console

        from stratagem.advisor.report.profile_table import profile_table

        Console().print(profile_table(profile))
    return 0
