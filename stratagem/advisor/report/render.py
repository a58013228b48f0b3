"""Render :class:`~stratagem.advisor.search.advice.Advice`: a rich table for the terminal, JSON,
Markdown, and a self-contained HTML page with plots (:mod:`~stratagem.advisor.report.html`).

Every format says the same things (:mod:`~stratagem.advisor.report.content`): the ranked plans,
the winner's memory and time breakdowns, the reasons, what the target left out, the notes and
how many plans were evaluated — or, when nothing fits, what would make the model fit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rich.columns import Columns
from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from stratagem.advisor.search.advice import Advice
from stratagem.advisor.cost.estimate import Estimate
from stratagem.advisor.report.content import (
    OVERLAP_NOTE, Term, step_note, excluded_lines, footer, memory_terms, offload_note, nothing_fits_line,
    plan_columns, plan_row, time_terms, title, winner_line, workload_line,
)
from stratagem.advisor.report.html import render_html
from stratagem.units import format_bytes, format_seconds

__all__ = ["render_html", "render_json", "render_markdown", "render_table"]

BAR_WIDTH = 10


def render_table(advice: Advice) -> RenderableType:
    """The terminal report: ranked plans, the winner's breakdowns, reasons, exclusions, notes."""
    parts: list[RenderableType] = [Text(title(advice), style="bold"), Text(workload_line(advice), style="dim")]
    if advice.best is None:
        parts.append(_nothing_fits_panel(advice))
    else:
        parts += [_PlansTable(advice), *_bullets("Why", advice.reasons), _breakdown_tables(advice.best)]
    parts += [*_bullets("Left out", excluded_lines(advice)), *_bullets("Notes", advice.notes, style="dim"),
              Text(footer(advice), style="dim")]
    return Group(*parts)


def render_json(advice: Advice) -> str:
    """``advice.to_dict()`` as indented JSON."""
    return json.dumps(advice.to_dict(), indent=2)


def render_markdown(advice: Advice) -> str:
    """The report as GitHub Markdown: the same content as the terminal, tables included."""
    lines = [f"# stratagem advise: {_md(advice.profile.name)}", "", f"{_md(title(advice))}  ",
             f"{_md(workload_line(advice))}", ""]
    best = advice.best
    if best is None:
        lines += ["## Nothing fits", "", _md(nothing_fits_line(advice)), "", *_md_items(advice.suggestions)]
    else:
        rows = [plan_row(rank, e) for rank, e in enumerate(advice.plans, 1)]
        lines += ["## Top plans", "", *_md_table(plan_columns(advice), rows, left=(1,))]
        lines += _md_section("Why", advice.reasons)
        lines += [f"## Breakdown of `{best.plan.name}`", ""]
        lines += [f"Memory per {best.device}: {winner_line(best)}", "", *_md_terms(memory_terms(best))]
        lines += [f"Time per step: {format_seconds(best.time.step_seconds)}{step_note(best)}", "",
                  *_md_terms(time_terms(best))]
    lines += _md_section("Left out", excluded_lines(advice)) + _md_section("Notes", advice.notes)
    return "\n".join([*lines, f"_{footer(advice)}_", ""])


# -- terminal --------------------------------------------------------------------------------

class _PlansTable:
    """The ranked plans. Where the width is short, plan names wrap (at spaces, else after a
    ``·``) and a blank line separates the rows."""

    def __init__(self, advice: Advice) -> None:
        self.advice = advice

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        header = plan_columns(self.advice)
        rows = [plan_row(rank, e) for rank, e in enumerate(self.advice.plans, 1)]
        widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
        overhead = 3 * len(header) - 3  # one space either side of a column, one between columns
        room = max(options.max_width - overhead - sum(widths) + widths[1], len(header[1]), 16)
        wraps = room < widths[1]
        table = Table(title="Top plans", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False, leading=1 if wraps else 0)
        for column in header:
            table.add_column(column, justify="left" if column == "plan" else "right", no_wrap=column != "plan",
                             overflow="fold")
        for rank, row in enumerate(rows, 1):
            name = _wrap_name(row[1], room) if wraps else row[1]
            table.add_row(row[0], name, *row[2:], style="bold green" if rank == 1 else None)
        yield table


def _wrap_name(name: str, width: int) -> str:
    """Break a plan name into lines of at most ``width``: at spaces, and after ``·`` in a word
    too long for a line."""
    lines = [""]
    for word in name.split():
        pieces = re.split(r"(?<=·)", word) if len(word) > width else [word]
        for i, piece in enumerate(pieces):
            glue = "" if i or not lines[-1] else " "
            if lines[-1] and len(lines[-1]) + len(glue) + len(piece) > width:
                lines.append(piece)
            else:
                lines[-1] += glue + piece
    return "\n".join(lines)


def _breakdown_tables(best: Estimate) -> RenderableType:
    capacity = f"of {format_bytes(best.capacity_bytes)} usable"
    memory = _term_table(f"Memory per {best.device}", memory_terms(best),
                         ("total", format_bytes(best.memory.total), capacity))
    time = _term_table("Time per step", time_terms(best), ("step", format_seconds(best.time.step_seconds), ""),
                       caption=step_note(best).strip())  # long: a cell of it would squeeze the figures
    heading = Text.assemble(("Winner: ", "bold"), (best.plan.name, "bold green"))
    host = offload_note(best).removeprefix("; ")
    return Group(Text(""), heading, *([Text(f"Also {host}.")] if host else []), Columns([memory, time], padding=(0, 4)))


def _term_table(heading: str, terms: Sequence[Term], total: tuple[str, str, str], *, caption: str = "") -> Table:
    """Term, value, share and a bar; a column of details (e.g. comm before overlap) if any; the
    total's row with a short note; ``caption`` under the table."""
    table = Table(title=heading, title_justify="left", title_style="bold", box=None, padding=(0, 1),
                  show_header=False)
    for justify in ("left", "right", "right", "left"):
        table.add_column(justify=justify, no_wrap=True)
    details = any(t.detail for t in terms)
    if details:
        table.add_column(no_wrap=True, style="dim")
    for term in terms:
        bar = Text("█" * round(term.share * BAR_WIDTH) or ("▏" if term.value else ""), style=term.color)
        table.add_row(term.label, term.text, f"{term.share:.0%}", bar, *([term.detail] if details else []),
                      style=None if term.value else "dim")
    table.add_section()
    label, value, note = total
    table.add_row(label, value, "", note, style="bold")
    captions = [text for text in (caption, OVERLAP_NOTE if details else "") if text]
    if captions:
        table.caption, table.caption_justify = "\n".join(captions), "left"
    return table


def _nothing_fits_panel(advice: Advice) -> Panel:
    parts: list[RenderableType] = [Text(nothing_fits_line(advice))]
    parts += _bullets("What would make it fit", advice.suggestions)
    return Panel(Group(*parts), title="Nothing fits", title_align="left", border_style="red")


def _bullets(heading: str, lines: Sequence[str], *, style: str = "") -> list[RenderableType]:
    if not lines:
        return []
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(style=style)
    for line in lines:
        grid.add_row("  •", line)
    return [Text(""), Text(heading, style="bold"), grid]


# -- markdown --------------------------------------------------------------------------------

def _md(text: str) -> str:
    """Escape what Markdown would read as table syntax or markup."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: tuple[int, ...] = (0,)) -> list[str]:
    align = ["---" if i in left else "---:" for i in range(len(header))]
    return [f"| {' | '.join(_md(h) for h in header)} |", f"| {' | '.join(align)} |",
            *(f"| {' | '.join(_md(c) for c in row)} |" for row in rows), ""]


def _md_terms(terms: Sequence[Term]) -> list[str]:
    if not any(t.detail for t in terms):
        return _md_table(("term", "value", "share"), [(t.label, t.text, f"{t.share:.1%}") for t in terms])
    rows = [(t.label, t.text, f"{t.share:.1%}", t.detail) for t in terms]
    return [*_md_table(("term", "value", "share", "before overlap"), rows, left=(0, 3)), OVERLAP_NOTE, ""]


def _md_items(lines: Sequence[str]) -> list[str]:
    return [*(f"- {_md(line)}" for line in lines), ""] if lines else []


def _md_section(heading: str, lines: Sequence[str]) -> list[str]:
    return [f"## {heading}", "", *_md_items(lines)] if lines else []
