"""What the commands share: the model and workload arguments, reading them, exit statuses."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stratagem.advisor.search.advice import OBJECTIVES  # light: the planning modules import no torch
from stratagem.plan import OPTIMIZERS

if TYPE_CHECKING:
    from stratagem.advisor.hardware import Cluster
    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.plan import Workload

EXIT_NOTHING_FITS = 1
"""Exit status of ``advise`` and ``verify`` when no plan fits (2 is a usage error)."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, workload and ranking arguments ``advise`` and ``verify`` share."""
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="throughput",
                        help="rank plans by the fastest step (throughput, the default) or the least memory per "
                        "device (memory)")
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a preset (e.g. llama-2-7b), 'pkg.module:factory' or 'hf:PATH/config.json'")
    parser.add_argument("--global-batch-size", type=positive_int, metavar="N", default=None,
                        help="samples per optimizer step (default: one per device)")
    parser.add_argument("--seq-len", type=positive_int, metavar="S", default=None,
                        help="tokens per sample (default: the model's; not for image models)")
    parser.add_argument("--precision", metavar="P", default="bf16-mixed",
                        help="fp32, bf16-mixed, fp16-mixed or bf16-true (default: bf16-mixed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="the optimizer whose states count in memory (default: adamw)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="profile the model again instead of reading a cached profile")


def model_workload(args: argparse.Namespace, cluster: Cluster) -> tuple[ModelProfile, Workload]:
    """The profile of ``--model`` and the workload the model arguments describe on ``cluster``."""
    from stratagem.plan import Workload
    from stratagem.advisor.profile.cache import profile_spec

    profile = profile_spec(args.model, seq_len=args.seq_len, precision=args.precision, cache=args.cache)
    workload = Workload(global_batch_size=args.global_batch_size or cluster.world_size, seq_len=profile.seq_len,
                        precision=args.precision, optimizer=args.optimizer)
    return profile, workload


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
