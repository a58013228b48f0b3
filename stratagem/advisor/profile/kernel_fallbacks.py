"""Fused-kernel functions of Hugging Face models, profiled through their PyTorch reference.

transformers wraps the fused kernels of state-space and linear-attention layers (``mamba_ssm``'s
selective scan, ``causal_conv1d``, flash-linear-attention's gated delta rule) in functions that
call the package where it is installed and a reference PyTorch implementation where it is not
(``use_kernel_func_from_hub_with_fallback``). The package kernels are CUDA-only and cannot run on
fake tensors, so the profile always runs the reference path, and says which functions it took:
a run with the packages installed keeps less for backward and runs faster than that profile
predicts; a run without them takes the reference path too (Mamba's: a Python loop over the
tokens, every token's state kept). Before those wrappers (transformers 4.x) the state-space mixers
chose for themselves: ``cuda_kernels_forward`` where the packages are installed and the weights
are on CUDA, else ``slow_forward``, which the profile's fake CPU tensors always take; the note
names those mixers instead. docs/cost-model.md, "Fused-kernel fallbacks".
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

_CLOSURE = ("torch_function", "func_name", "package", "is_new_implementation")
"""What transformers' fallback wrapper closes over (``transformers.integrations.hub_kernels``)."""


SLOW_PATH_PACKAGES = ("mamba-ssm", "causal-conv1d")
"""The kernels a transformers 4.x state-space mixer's ``cuda_kernels_forward`` calls (Mamba, Mamba2,
Jamba, FalconMamba and the hybrids built on their mixers)."""


def _chooses_its_path(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers 4.x mixer that picks its fused kernels or its reference
    path itself (``cuda_kernels_forward`` beside ``slow_forward``)."""
    return callable(getattr(module, "cuda_kernels_forward", None)) and callable(getattr(module, "slow_forward", None))


class Fallback(NamedTuple):
    """One fused-kernel wrapper: its reference function, its name, the package and whether it is installed."""

    reference: Callable[..., Any]
    name: str
    distribution: str
    installed: bool


def _fallback(value: Any) -> Fallback | None:
    """What a transformers fused-kernel wrapper wraps, or None for anything else."""
    if not inspect.isfunction(value) or not hasattr(value, "__wrapped__"):
        return None
    try:
        closure = inspect.getclosurevars(value).nonlocals
    except (TypeError, ValueError):
        return None
    if not all(name in closure for name in _CLOSURE):
        return None
    package = closure["package"]  # an import name; the pip name where transformers maps one (fla)
    distribution = value.__globals__.get("_PACKAGE_TO_DISTRIBUTION", {}).get(package, package)
    return Fallback(closure["torch_function"], closure["func_name"], distribution,
                    bool(closure["is_new_implementation"]))


class KernelFallbacks:
    """While entered, the fused-kernel wrappers of ``model``'s modeling modules call their reference
    PyTorch function and record that they did (:meth:`note`)."""

    def __init__(self, model: nn.Module) -> None:
        self.ran: set[Fallback] = set()
        self._patched: list[tuple[dict[str, Any], str, Any]] = []
        namespaces = {id(ns): ns for ns in (vars(sys.modules[type(m).__module__]) for m in model.modules()
                                            if type(m).__module__ in sys.modules)}
        self._found = [(ns, name, value, fallback) for ns in namespaces.values() for name, value in list(ns.items())
                       if (fallback := _fallback(value)) is not None]
        self.slow_paths = sorted({type(m).__name__ for m in model.modules() if _chooses_its_path(m)})

    def __enter__(self) -> KernelFallbacks:
        for namespace, name, value, fallback in self._found:
            namespace[name] = self._reference(fallback)
            self._patched.append((namespace, name, value))
        return self

    def __exit__(self, *exc: object) -> None:
        for namespace, name, value in self._patched:
            namespace[name] = value
        self._patched.clear()

    def _reference(self, fallback: Fallback) -> Callable[..., Any]:
        parameters = inspect.signature(fallback.reference).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

        @functools.wraps(fallback.reference)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.ran.add(fallback)
            kept = kwargs if takes_any else {k: v for k, v in kwargs.items() if k in parameters}
            return fallback.reference(*args, **kept)

        return run

    def note(self) -> str | None:
        """What the profile ran in place of fused kernels, and what that means for a run; None if nothing."""
        if self.slow_paths and not self.ran:
            return (f"{', '.join(self.slow_paths)} profiled through slow_forward, transformers' reference PyTorch "
                    f"path, as a run off CUDA or without {', '.join(SLOW_PATH_PACKAGES)} takes it; with them "
                    "installed on CUDA, cuda_kernels_forward keeps less for backward and runs faster than predicted")
        if not self.ran:
            return None
        packages = sorted({f.distribution for f in self.ran})
        installed = sorted({f.distribution for f in self.ran if f.installed})
        where = f"{', '.join(installed)} installed here" if installed else "not installed here"
        return (f"{', '.join(sorted(f.name for f in self.ran))} profiled through transformers' reference PyTorch "
                f"path, as a run without {', '.join(packages)} ({where}) takes it; with them installed on CUDA, "
                "the fused kernels keep less for backward and run faster than predicted")
