"""Pipeline partition: the profile's blocks split into contiguous stages of balanced cost.

A stage's time is its profiled forward + backward FLOPs, and the bytes its operators without
FLOPs move weighed as the FLOPs the device runs in their time (``byte_flops``: the head's
logits and their fp32 softmax move gigabytes for a large vocabulary, with few FLOPs beside
them); the first stage also runs the embedding, the last the head and the loss. The slowest
stage sets the pace of the whole pipeline (Narayanan et al. 2021, §2.2: every stage runs each
micro-batch in turn), so the partition minimises the largest stage time first and, among
partitions as fast, the largest stage memory (its parameters plus the activations it saves for
one micro-batch): a dynamic program over contiguous splits, O(stages × blocks²), exact for the
slowest stage, with memory breaking ties among equally fast prefixes. The cost model then costs
the partition rank by rank (:mod:`~stratagem.advisor.cost.pace`): the split weighs a stage by
these sums, not by every term of the step.
"""

from __future__ import annotations

from stratagem.advisor.memo import by_identity
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.errors import UsageError

__all__ = ["balanced_stage_blocks", "stage_costs"]

# What a stage's balance compares: (forward + backward FLOPs with the bytes moved as FLOPs, bytes held).
Cost = tuple[float, int]


def balanced_stage_blocks(profile: ModelProfile, num_stages: int, *, byte_flops: float = 0.0,
                          compiled: bool = False) -> tuple[int, ...]:
    """Blocks per stage, ``num_stages`` contiguous stages of at least one block each, that
    minimise the slowest stage's profiled time, then the largest stage's memory. ``byte_flops``:
    the FLOPs a byte moved by operators without FLOPs weighs as
    (:func:`~stratagem.advisor.cost.rates.flops_per_moved_byte`; 0 counts FLOPs alone);
    ``compiled``: the blocks move their fused bytes (the plan compiles them, the embedding and
    head stay eager)."""
    num_blocks = len(profile.blocks)
    if not 1 <= num_stages <= num_blocks:
        raise UsageError(f"{num_stages} pipeline stages but {profile.name} has {num_blocks} blocks\n"
                         f"HINT: use at most {num_blocks} stages (pp × pp_virtual)")
    return _balanced(profile, num_stages, byte_flops, compiled)


def stage_costs(profile: ModelProfile, stage_blocks: tuple[int, ...], *, byte_flops: float = 0.0,
                compiled: bool = False) -> tuple[Cost, ...]:
    """(time as FLOPs, bytes) of each stage of ``stage_blocks``: its blocks, plus the embedding on
    the first stage and the head on the last (``byte_flops`` and ``compiled`` as
    :func:`balanced_stage_blocks` weighs them)."""
    totals, start, last = [], 0, len(stage_blocks) - 1
    for i, count in enumerate(stage_blocks):
        costs = [_cost(block, byte_flops, compiled=compiled) for block in profile.blocks[start:start + count]]
        ends = ((profile.embed, i == 0), (profile.head, i == last))
        costs += [_cost(segment, byte_flops, compiled=False) for segment, held in ends if held]
        totals.append((sum(c[0] for c in costs), sum(c[1] for c in costs)))
        start += count
    return tuple(totals)


def _cost(segment: SegmentProfile, byte_flops: float, *, compiled: bool) -> Cost:
    fused = "fused_" if compiled else ""
    moved = sum(getattr(segment, f"{d}_{fused}op_bytes") + getattr(segment, f"{d}_param_op_bytes") for d in ("fwd", "bwd"))
    return segment.fwd_flops + segment.bwd_flops + byte_flops * moved, segment.param_bytes + segment.saved_bytes


@by_identity
def _balanced(profile: ModelProfile, num_stages: int, byte_flops: float, compiled: bool) -> tuple[int, ...]:
    n, spans = len(profile.blocks), _spans(profile, byte_flops, compiled)
    # best[k][j]: the lexicographically smallest (max FLOPs, max bytes) of blocks 0..j-1 in k
    # stages, and where its last stage starts.
    best: list[dict[int, tuple[Cost, int]]] = [{0: ((0, 0), 0)}]
    for k in range(1, num_stages + 1):
        prev, row = best[-1], {}
        reach = max(prev) + 1  # k - 1 stages end before block reach
        for j in range(k, n - (num_stages - k) + 1):  # leave a block for each stage still to come
            options = []
            for i in range(k - 1, min(j, reach)):  # where the last stage starts
                (worst_flops, worst_bytes), _ = prev[i]
                flops, size = spans[j][i]
                options.append(((worst_flops if worst_flops > flops else flops,
                                 worst_bytes if worst_bytes > size else size), i))
            row[j] = min(options)
        best.append(row)
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        i = best[k][j][1]
        counts.append(j - i)
        j = i
    return tuple(reversed(counts))


@by_identity
def _spans(profile: ModelProfile, byte_flops: float, compiled: bool) -> list[list[Cost]]:
    """``spans[j][i]``: the cost of a stage of blocks ``i..j-1``, with the embedding if it is the
    first and the head if it is the last."""
    n = len(profile.blocks)
    prefix: list[Cost] = [(0, 0)]
    for block in profile.blocks:
        flops, size = _cost(block, byte_flops, compiled=compiled)
        prefix.append((prefix[-1][0] + flops, prefix[-1][1] + size))
    embed, head = (_cost(s, byte_flops, compiled=False) for s in (profile.embed, profile.head))
    spans = []
    for j in range(n + 1):
        row = []
        for i in range(j):
            flops, size = prefix[j][0] - prefix[i][0], prefix[j][1] - prefix[i][1]
            if i == 0:
                flops, size = flops + embed[0], size + embed[1]
            if j == n:
                flops, size = flops + head[0], size + head[1]
            row.append((flops, size))
        spans.append(row)
    return spans
