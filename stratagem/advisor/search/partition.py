"""Pipeline partition: the profile's blocks split into contiguous stages of balanced cost.

A stage's time is its profiled forward + backward FLOPs (the time model divides FLOPs by one
achievable rate, so FLOPs order stages as time does); the first stage also runs the embedding,
the last the head and the loss. The slowest stage sets the pace of the whole pipeline
(Narayanan et al. 2021, §2.2: every stage runs each micro-batch in turn), so the partition
minimises the largest stage time first and, among partitions as fast, the largest stage
memory (its parameters plus the activations it saves for one micro-batch): a dynamic program
over contiguous splits, O(stages × blocks²), exact for the slowest stage, with memory breaking
ties among equally fast prefixes.
"""

from __future__ import annotations

from stratagem.advisor.memo import by_identity
from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.errors import UsageError

__all__ = ["balanced_stage_blocks", "stage_costs"]

Cost = tuple[int, int]  # (forward + backward FLOPs, bytes): what a stage's balance compares


def balanced_stage_blocks(profile: ModelProfile, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage, ``num_stages`` contiguous stages of at least one block each, that
    minimise the slowest stage's profiled time, then the largest stage's memory."""
    num_blocks = len(profile.blocks)
    if not 1 <= num_stages <= num_blocks:
        raise UsageError(f"{num_stages} pipeline stages but {profile.name} has {num_blocks} blocks\n"
                         f"HINT: use at most {num_blocks} stages (pp × pp_virtual)")
    return _balanced(profile, num_stages)


def stage_costs(profile: ModelProfile, stage_blocks: tuple[int, ...]) -> tuple[Cost, ...]:
    """(FLOPs, bytes) of each stage of ``stage_blocks``: its blocks, plus the embedding on the
    first stage and the head on the last."""
    costs, start = [], 0
    for i, count in enumerate(stage_blocks):
        segments = list(profile.blocks[start:start + count])
        if i == 0:
            segments.append(profile.embed)
        if i == len(stage_blocks) - 1:
            segments.append(profile.head)
        costs.append(_sum(segments))
        start += count
    return tuple(costs)


def _cost(segment: SegmentProfile) -> Cost:
    return segment.fwd_flops + segment.bwd_flops, segment.param_bytes + segment.saved_bytes


def _sum(segments: list[SegmentProfile]) -> Cost:
    costs = [_cost(s) for s in segments]
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


@by_identity
def _balanced(profile: ModelProfile, num_stages: int) -> tuple[int, ...]:
    n, spans = len(profile.blocks), _spans(profile)
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
def _spans(profile: ModelProfile) -> list[list[Cost]]:
    """``spans[j][i]``: the cost of a stage of blocks ``i..j-1``, with the embedding if it is the
    first and the head if it is the last."""
    n = len(profile.blocks)
    prefix: list[Cost] = [(0, 0)]
    for block in profile.blocks:
        flops, size = _cost(block)
        prefix.append((prefix[-1][0] + flops, prefix[-1][1] + size))
    embed, head = _cost(profile.embed), _cost(profile.head)
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
