"""What the commands share: the model and workload arguments, reading them, exit statuses."""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.advisor.search.advice import OBJECTIVES  # light: the planning modules import no torch
from stratagem.advisor.hardware.parse import MAX_DEVICES_PER_NODE
from stratagem.errors import UsageError
from stratagem.plan import OPTIMIZERS
from stratagem.plan.workload import GRAD_CLIPS
from stratagem.plan.checks import MAX_SAMPLES
from stratagem.plan.precision import PRECISIONS

if TYPE_CHECKING:
    from stratagem.advisor.hardware import Cluster
    from stratagem.advisor.profile.model_profile import ModelProfile
    from stratagem.plan import Workload

EXIT_NOTHING_FITS = 1
"""Exit status of ``advise`` and ``verify`` when no plan fits (2 is a usage error)."""
PRECISION_NAMES = ", ".join(list(PRECISIONS)[:-1]) + f" or {list(PRECISIONS)[-1]}"
"""The precisions a plan may name, for help texts: ``fp32, bf16-mixed, … or fp16-true``."""


def add_model_arguments(parser: argparse.ArgumentParser, *, plan_defaults: bool = False) -> None:
    """The model, workload and ranking arguments ``advise``, ``verify`` and ``explain`` share;
    with ``plan_defaults`` (``explain``), the global batch and precision default to the first
    plan's (``--precision`` then defaults to None, read as the plan's or ``bf16-mixed``)."""
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="throughput",
                        help="rank plans by the fastest step (throughput, the default) or the least memory per "
                        "device (memory)")
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a preset (e.g. llama-2-7b), 'pkg.module:factory' or 'hf:PATH/config.json'")
    parser.add_argument("--global-batch-size", type=SAMPLES, metavar="N", default=None,
                        help="samples per optimizer step (default: "
                        + ("the first plan's)" if plan_defaults else "one per device)"))
    parser.add_argument("--seq-len", type=SAMPLES, metavar="S", default=None,
                        help="tokens per sample (default: the model's; not for image models)")
    parser.add_argument("--precision", metavar="P", default=None if plan_defaults else "bf16-mixed",
                        help=f"{PRECISION_NAMES} (default: "
                        + ("the first plan's, else " if plan_defaults else "") + "bf16-mixed)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="the optimizer whose states and step are priced: adamw, or sgd with momentum "
                        "(default: adamw)")
    parser.add_argument("--grad-clip", choices=GRAD_CLIPS, default=None,
                        help="price clipping the gradients before each optimizer step, by their global norm or "
                        "each element by value, as Lightning's gradient_clip_val does (default: not clipped)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="profile the model again instead of reading a cached profile")


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """``--no-compile``, which ``advise`` and ``verify`` share (:func:`compile_constraints`)."""
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="leave out plans that torch.compile their blocks (a model that does not compile, or "
                        "a run that cannot wait for it)")


def compile_constraints(args: argparse.Namespace) -> dict[str, bool]:
    """The search constraints ``--no-compile`` stands for."""
    return {} if args.compile else {"compile": False}


def profile_phase(args: argparse.Namespace) -> str:
    """What the profile phase of ``advise`` and ``verify`` profiles, for their progress lines."""
    return f"{args.model}" + (f", {args.seq_len} tokens" if args.seq_len else "") + f", {args.precision}"


def model_workload(args: argparse.Namespace, cluster: Cluster) -> tuple[ModelProfile, Workload]:
    """The profile of ``--model`` and the workload the model arguments describe on ``cluster``."""
    from stratagem.plan import Workload
    from stratagem.advisor.profile.cache import profile_spec
    from stratagem.advisor.profile.model_profile import kernels_for

    profile = profile_spec(args.model, seq_len=args.seq_len, precision=args.precision, cache=args.cache,
                           kernels=kernels_for(accelerator=cluster.is_accelerator))
    workload = Workload(global_batch_size=args.global_batch_size or cluster.world_size, seq_len=profile.seq_len,
                        precision=args.precision, optimizer=args.optimizer, grad_clip=args.grad_clip)
    return profile, workload


def _int_in(text: str, minimum: int, maximum: int | None, why: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum:,} ({why}), got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return _int_in(text, 1, None, "")


def bounded_int(minimum: int, maximum: int, why: str) -> Callable[[str], int]:
    """argparse type: an integer from ``minimum`` to ``maximum`` (``why`` says where the limit comes from)."""
    return functools.partial(_int_in, minimum=minimum, maximum=maximum, why=why)


SAMPLES = bounded_int(1, MAX_SAMPLES, "a step's samples and a sample's tokens are 32-bit counts, so that a "
                      "step's tokens are a 64-bit index")
"""argparse type of a batch size or a sequence length."""
LOCAL_RANKS = bounded_int(1, MAX_DEVICES_PER_NODE, "more ranks than any node holds")
"""argparse type of the ranks a command spawns on this host."""
STEPS = bounded_int(1, 1000, "a few steps measure a plan; more is a training run")
"""argparse type of the steps ``verify`` measures."""
WARMUP_STEPS = bounded_int(0, 1000, "a few steps warm a plan up")
"""argparse type of the steps ``verify`` runs before measuring."""
REPEATS = bounded_int(1, 100, "a few runs show the noise; each starts its processes afresh")
"""argparse type of the runs of each plan ``verify`` pools."""


def seconds(text: str) -> float:
    """argparse type: a finite, positive number of seconds, at most a week."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 7 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most a week (604,800 s), got {text}")
    return value


def file_name(text: str) -> Path:
    """argparse type: a path naming a file (not empty, not a folder)."""
    if not text or Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name" + (" (it is a folder)" if text else ""))
    return Path(text)


def check_writable(path: Path | None, what: str) -> None:
    """Raise :class:`UsageError` unless this process can write ``path`` (a file is created and
    removed beside it): checked before the work whose result goes there."""
    if path is None:
        return
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as err:
        raise UsageError(f"cannot write {what} to {path}: {err.strerror or err}\n"
                         "HINT: give --output a path in a folder that exists and is writable") from None
