"""Render a ModelProfile as a rich table, identical consecutive blocks folded into one row."""

from __future__ import annotations

from rich.table import Table

from stratagem.advisor.profile.model_profile import ModelProfile, SegmentProfile
from stratagem.units import format_bytes, format_count, format_params


def _runs(blocks: tuple[SegmentProfile, ...]) -> list[list[SegmentProfile]]:
    """Consecutive blocks measured as the same representative, grouped."""
    runs: list[list[SegmentProfile]] = []
    for block in blocks:
        rep = block.measurement
        if runs and runs[-1][0].measurement == rep:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _row(label: str, seg: SegmentProfile, times: int) -> list[str]:
    return [
        label,
        format_params(seg.num_params * times),
        format_count(seg.fwd_flops * times),
        format_count(seg.bwd_flops * times),
        format_bytes(seg.saved_bytes * times),
        format_bytes(seg.compiled_saved_bytes * times) if seg.compiled_saved_bytes else "-",
        format_bytes(seg.output_bytes),
    ]


def profile_table(profile: ModelProfile) -> Table:
    """One row per segment (embedding, each run of identical blocks, head) and a total.

    FLOPs and bytes of a folded row are for all its blocks; ``output`` is per block; ``compiled``
    is what a block keeps for backward compiled (``-`` outside the blocks, or not measured)."""
    shape = f"batch {profile.batch_size}" + (f" × seq {profile.seq_len}" if profile.seq_len else "")
    kinds = "/".join(dict.fromkeys(b.kind for b in profile.blocks))
    blocks = f" · blocks: {profile.block_container} ({kinds})" if profile.blocks else ""
    table = Table(title=f"{profile.name} · {shape} · {profile.precision}{blocks}", title_justify="left")
    for column in ("segment", "params", "fwd FLOP", "bwd FLOP", "saved", "compiled", "output"):
        table.add_column(column, justify="left" if column == "segment" else "right", no_wrap=True)
    table.add_row(*_row("embed", profile.embed, 1))
    for run in _runs(profile.blocks):
        first, last = (b.name.rsplit(".", 1)[-1] for b in (run[0], run[-1]))
        label = f"block {first}" if len(run) == 1 else f"blocks {first}–{last} ×{len(run)}"
        table.add_row(*_row(label, run[0], len(run)))
    table.add_row(*_row("head + loss", profile.head, 1))
    table.add_section()
    table.add_row("total", format_params(profile.num_params), format_count(profile.fwd_flops),
                  format_count(profile.bwd_flops), format_bytes(profile.saved_bytes), "", "", style="bold")
    notes = [f"profiled in {profile.profile_seconds:.2f} s on fake tensors", *profile.notes]
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table
