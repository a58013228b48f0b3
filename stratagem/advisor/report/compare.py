"""Render a :class:`~stratagem.advisor.search.given_plans.Comparison` (``stratagem explain``): both
plans' memory and time terms side by side with the difference, the totals, and why one wins; as a
rich table or JSON. Terms and labels are the ``advise`` report's (:mod:`.content`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from stratagem.advisor.report.content import Term, memory_cell, memory_terms, time_terms, title, workload_line
from stratagem.advisor.search.given_plans import Comparison
from stratagem.units import format_bytes, format_count, format_seconds

__all__ = ["comparison_rows", "render_comparison_json", "render_comparison_table"]


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the comparison: a term's or a total's value for A and B (bytes, seconds,
    samples or tokens per second, a fraction), and the cells showing them."""

    section: str  # "memory", "time" or "total"
    key: str
    label: str
    values: tuple[float, float]
    cells: tuple[str, str, str]  # A, B, B − A


def comparison_rows(comparison: Comparison) -> list[Row]:
    """Every memory term, every time term, then the totals, in the ``advise`` report's order."""
    a, b = comparison.estimates
    rows = [_term_row("memory", x, y, format_bytes) for x, y in zip(memory_terms(a), memory_terms(b))]
    if a.memory.host or b.memory.host:
        rows.append(_row("memory", "host", "offloaded to host", a.memory.host, b.memory.host, format_bytes))
    rows += [_term_row("time", x, y, format_seconds) for x, y in zip(time_terms(a), time_terms(b))]
    unit = a.throughput_unit
    rows += [
        Row("total", "memory", f"memory / {a.device}", (a.memory.total, b.memory.total),
            (memory_cell(a), memory_cell(b), _signed(b.memory.total - a.memory.total, format_bytes))),
        _row("total", "step_seconds", "step", a.time.step_seconds, b.time.step_seconds, format_seconds),
        Row("total", "throughput", unit, (a.throughput, b.throughput),
            (format_count(a.throughput), format_count(b.throughput), _ratio(b.throughput / a.throughput))),
        Row("total", "mfu", "MFU", (a.mfu, b.mfu), (f"{a.mfu:.1%}", f"{b.mfu:.1%}", f"{(b.mfu - a.mfu) * 100:+.1f} pt")),
    ]
    return rows


def _term_row(section: str, x: Term, y: Term, fmt: Callable[[float], str]) -> Row:
    """A breakdown term of both plans."""
    return Row(section, x.key, x.label, (x.value, y.value), (x.text, y.text, _signed(y.value - x.value, fmt)))


def _row(section: str, key: str, label: str, a: float, b: float, fmt: Callable[[float], str]) -> Row:
    return Row(section, key, label, (a, b), (fmt(a), fmt(b), _signed(b - a, fmt)))


def _signed(delta: float, fmt: Callable[[float], str]) -> str:
    """``+36.1 ms``, ``-1.7 MiB``; empty when there is no difference."""
    if delta == 0:
        return ""
    return ("+" if delta > 0 else "-") + fmt(abs(delta))


def _ratio(ratio: float) -> str:
    """``×11.3`` from twice up, else ``+4%``/``-91%``."""
    return f"×{ratio:.1f}" if ratio >= 2 else f"{ratio - 1:+.0%}"


def plan_lines(comparison: Comparison) -> list[tuple[str, str, str]]:
    """Label, plan name and where each plan came from; the winner's marked."""
    out = []
    for i, (label, estimate, source) in enumerate(zip(comparison.labels, comparison.estimates, comparison.sources)):
        mark = " (wins)" if comparison.winner == i else "" if estimate.fits else " (does not fit)"
        out.append((label, estimate.plan.name, source + mark))
    return out


def render_comparison_table(comparison: Comparison) -> RenderableType:
    """The terminal comparison: the plans, one row per term and total, and why one wins."""
    legend = Table.grid(padding=(0, 2))
    for i, (label, name, source) in enumerate(plan_lines(comparison)):
        legend.add_row(label, name, source, style="bold green" if comparison.winner == i else None)
    a_label, b_label = comparison.labels
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for header, justify in (("", "left"), (a_label, "right"), (b_label, "right"), (f"{b_label} − {a_label}", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    section = None
    for row in comparison_rows(comparison):
        if row.section != section:
            if section is not None:
                table.add_section()
            section = row.section
            heading = {"memory": f"Memory per {comparison.estimates[0].device}", "time": "Time per step"}.get(section)
            if heading:
                table.add_row(Text(heading, style="bold"))
        style = None if any(row.values) else "dim"
        table.add_row(f"  {row.label}" if row.section != "total" else row.label, *_cells(comparison, row),
                      style="bold" if row.section == "total" else style)
    why = Table.grid(padding=(0, 1))
    why.add_column(no_wrap=True)
    why.add_column()
    for line in comparison.reasons:
        why.add_row("  •", line)
    return Group(Text(title(comparison), style="bold"), Text(workload_line(comparison), style="dim"), Text(""),
                 legend, Text(""), table, Text(""), Text("Why", style="bold"), why)


def _cells(comparison: Comparison, row: Row) -> tuple[Text | str, ...]:
    """A row's cells; the memory total of a plan that does not fit in red."""
    cells: list[Text | str] = list(row.cells)
    if row.section == "total" and row.key == "memory":
        for i, estimate in enumerate(comparison.estimates):
            if not estimate.fits:
                cells[i] = Text(cells[i], style="bold red")
    return tuple(cells)


def render_comparison_json(comparison: Comparison) -> str:
    """The comparison as indented JSON: the workload, both plans costed (as ``advise --format
    json`` entries), every row of the table with raw values, the winner and the reasons."""
    labels = comparison.labels
    rows = [{"section": r.section, "key": r.key, "label": r.label, **dict(zip(labels, r.values)),
             "delta": r.values[1] - r.values[0]} for r in comparison_rows(comparison)]
    data = {
        "model": comparison.profile.name,
        "cluster": comparison.cluster.spec,
        "world_size": comparison.cluster.world_size,
        "workload": comparison.workload.to_dict(),
        "objective": comparison.objective,
        "plans": {label: {"source": source, **estimate.to_dict()}
                  for label, source, estimate in zip(labels, comparison.sources, comparison.estimates)},
        "rows": rows,
        "winner": None if comparison.winner is None else labels[comparison.winner],
        "reasons": list(comparison.reasons),
    }
    return json.dumps(data, indent=2)
