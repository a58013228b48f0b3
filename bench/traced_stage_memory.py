"""What a pipeline stage built by tracing leaves resident beyond its parameters, on the CPU.

vit-small's stages are traced (``torch.distributed.pipelining.pipeline``, torch.export), not
built by removal. In one process, with the tracing machinery loaded first as ``verify``'s ranks
load it (``_load_tracing``), this builds the model, traces the first of two stages, drops the
model and collects: the resident memory left beyond the stage's parameters is the trace's own
(its graph modules and generated code, the exporter's caches and the modules it imported for
the model's operators), split into what glibc's malloc holds and what lies outside it (Python's
object arenas). Three more traces of a fresh copy show how much each adds again.

    .venv/bin/python bench/traced_stage_memory.py      # about half a minute on 2 cores
"""

from __future__ import annotations

import ctypes
import gc

import psutil
import torch

from stratagem.advisor.profile.cache import profile_spec
from stratagem.peak_memory import PeakMemory
from stratagem.plan import Plan
from stratagem.plugins.traced_stages import traced_stages
from stratagem.verify import runner
from stratagem.verify.models import real_model

MIB = 2**20
MODEL, MICRO_BATCH = "vit-small", 2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_bytes() -> int:
    """Bytes glibc's malloc holds from the system: its heaps and its mapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.arena + info.hblkhd


def anonymous() -> int:
    """Bytes of this process resident and not file-backed (shared libraries' code left out)."""
    info = psutil.Process().memory_info()
    return info.rss - info.shared


def main() -> None:
    torch.set_num_threads(1)
    profile = profile_spec(MODEL, seq_len=None, precision="fp32", kernels="cpu")
    plan = Plan(pp=2, microbatches=2, micro_batch_size=MICRO_BATCH, precision="fp32",
                block_container=profile.block_container)
    bounds = [0, len(profile.blocks) // 2]
    runner._load_tracing()
    model = real_model(MODEL, seq_len=None)
    batch = model.make_batch(2 * MICRO_BATCH)
    example = tuple(t[:MICRO_BATCH] for t in batch.args)
    PeakMemory(torch.device("cpu"))  # freed tensors handed back, as verify measures
    start, start_malloc = anonymous(), malloc_bytes()
    built = model.build(2 * MICRO_BATCH, batch)
    stage, = traced_stages(built.module, plan, bounds, (0,), example)
    del built
    gc.collect()
    params = sum(p.numel() * p.element_size() for p in stage.parameters())
    left, in_malloc = anonymous() - start - params, malloc_bytes() - start_malloc - params
    print(f"{MODEL} stage 0 of 2, traced: parameters {params / MIB:.1f} MiB; resident beyond them "
          f"{left / MIB:.1f} MiB ({in_malloc / MIB:.1f} in malloc, {(left - in_malloc) / MIB:.1f} outside it)")
    for again in range(1, 4):
        before = anonymous()
        built = model.build(2 * MICRO_BATCH, batch)
        traced_stages(built.module, plan, bounds, (0,), example)
        del built
        gc.collect()
        print(f"trace {again + 1}: {(anonymous() - before) / MIB:+.1f} MiB resident")


if __name__ == "__main__":
    main()
