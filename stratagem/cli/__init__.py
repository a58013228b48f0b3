"""The ``stratagem`` command line (also installed as ``advise``).

Each subcommand lives in its own module with ``register(subparsers)``, which adds its parser
and sets ``handler``. Heavy imports happen inside the handlers, so ``stratagem --help`` is fast.
A :class:`~stratagem.errors.UsageError` is printed as one message and exits with status 2; a
:class:`~stratagem.errors.PeerLost` (a rank of ``calibrate`` died) too, with status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stratagem import __version__
from stratagem.cli import advise_cmd, calibrate_cmd, explain_cmd, hardware_cmd, profile_cmd, verify_cmd
from stratagem.errors import PeerLost, UsageError

_SUBCOMMANDS = (advise_cmd, explain_cmd, profile_cmd, hardware_cmd, calibrate_cmd, verify_cmd)

EXIT_USAGE = 2
EXIT_PEER_LOST = 1
"""A rank of the command's own processes died: no fault of the input."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="How should I parallelize this model on this cluster?",
    )
    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``stratagem COMMAND ...``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UsageError as err:
        print(f"stratagem {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except PeerLost as err:
        print(f"stratagem {args.command}: error: {err}", file=sys.stderr)
        return EXIT_PEER_LOST


def advise_main(argv: Sequence[str] | None = None) -> int:
    """The ``advise`` console script: the same as ``stratagem advise``."""
    return main(["advise", *(sys.argv[1:] if argv is None else argv)])
