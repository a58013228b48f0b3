"""Inline SVG figures for the HTML report, written by hand (no plotting library, nothing fetched).

Every text that reaches the SVG goes through :func:`html.escape`. Colours come from
:mod:`~stratagem.advisor.report.content`, so a term has one colour in every figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from html import escape

from stratagem.plan import Plan
from stratagem.advisor.report.content import TIME_TERMS, Term
from stratagem.advisor.report.schedule import BACKWARD_UNITS, FORWARD_UNITS, Pass, simulate_pipeline

WIDTH = 880
LEFT, RIGHT = 16, 96  # room for the total printed after each bar
ROW, BAR = 46, 18
FORWARD_COLOR = TIME_TERMS["compute"][1]
BACKWARD_COLOR = "#284b73"  # compute, darker: a backward pass is compute too
IDLE_COLOR = TIME_TERMS["bubble"][1]
TIMELINE_LEFT = 64  # room for the rank labels
MIN_FORWARD_PX = 12  # narrowest forward box drawn: its micro-batch number still fits


def stacked_bars(rows: Sequence[tuple[str, Sequence[Term]]], *, label: str, fmt: Callable[[float], str],
                 tick_unit: float = 1.0, marker: tuple[float, str] | None = None) -> str:
    """Horizontal stacked bars, one per ``(label, terms)`` row, on a shared axis; ``marker``
    draws a dashed vertical line (e.g. the usable memory) at ``(value, label)``."""
    totals = [sum(t.value for t in terms) for _, terms in rows]
    top = max([*totals, marker[0] if marker else 0.0]) * 1.04 or 1.0
    scale = (WIDTH - LEFT - RIGHT) / top
    plot_top, height = 22, 22 + ROW * len(rows)
    parts = _axis(top, scale, plot_top=plot_top, bottom=height, fmt=fmt, tick_unit=tick_unit)
    for i, ((label, terms), total) in enumerate(zip(rows, totals)):
        y = plot_top + i * ROW
        parts.append(_text(LEFT, y + 12, label, weight="600"))
        parts.extend(_segments(terms, x0=LEFT, y=y + 18, scale=scale, fmt=fmt))
        parts.append(_text(LEFT + total * scale + 6, y + 18 + BAR - 5, fmt(total)))
    if marker:
        parts.append(_marker(LEFT + marker[0] * scale, marker[1], top=8, bottom=height))
    return _svg(height + 26, parts, label=label)


def drawable_plan(plan: Plan) -> Plan:
    """``plan`` with no more micro-batches than its timeline can draw legibly (forward boxes of
    at least MIN_FORWARD_PX), keeping what the schedule needs: ``pp`` of them at least, a
    multiple of ``pp`` for interleaved 1F1B."""
    slots = (WIDTH - TIMELINE_LEFT - 16) / MIN_FORWARD_PX / (FORWARD_UNITS + BACKWARD_UNITS)
    most = int((slots - plan.pp + 1) / plan.pp_virtual)
    if plan.is_interleaved:
        most -= most % plan.pp
    fewest = min(plan.pp, plan.microbatches) if plan.pp_schedule == "gpipe" else plan.pp
    return replace(plan, microbatches=min(plan.microbatches, max(most, fewest)))


def pipeline_timeline(plan: Plan, *, uid: str = "0") -> str:
    """The schedule of ``plan`` (``pp > 1``) as one row per pipeline rank, boxes per pass;
    passes of odd virtual stages are striped. ``uid`` keeps the stripe pattern's id unique.

    An illustration of the order and the bubble (forward 1 unit, backward 2; see
    :mod:`~stratagem.advisor.report.schedule`), not a prediction of seconds."""
    timeline = simulate_pipeline(plan)
    left, row, box = TIMELINE_LEFT, 30, 22
    scale = (WIDTH - left - 16) / timeline.makespan
    parts = [f'<defs><pattern id="stripes-{uid}" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.5"/>'
             "</pattern></defs>"]
    for rank in range(timeline.num_ranks):
        y = 8 + rank * row
        parts.append(_text(8, y + box - 7, f"rank {rank}"))
        parts.append(_rect(left, y, timeline.makespan * scale, box, IDLE_COLOR, "idle: pipeline bubble"))
    for p in timeline.passes:
        parts.append(_pass_box(p, x=left + p.start * scale, y=8 + p.rank * row, w=(p.end - p.start) * scale,
                               h=box, uid=uid, virtual=plan.pp_virtual > 1))
    return _svg(16 + row * timeline.num_ranks, parts, label=f"pipeline schedule of {plan.name}")


def _pass_box(p: Pass, *, x: float, y: float, w: float, h: float, uid: str, virtual: bool) -> str:
    what = "forward" if p.kind == "F" else "backward"
    tip = f"{what} of micro-batch {p.microbatch}" + (f", virtual stage {p.chunk}" if virtual else "")
    box = _rect(x, y, w, h, FORWARD_COLOR if p.kind == "F" else BACKWARD_COLOR, tip, stroke="#fff")
    if p.chunk % 2:
        box += (f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{h}" fill="url(#stripes-{uid})" '
                'pointer-events="none"/>')
    if w >= MIN_FORWARD_PX - 1:
        box += _text(x + w / 2, y + h - 7, str(p.microbatch), anchor="middle", fill="#fff", size=10, weight="600")
    return box


def nice_step(span: float, *, target: int = 5) -> float:
    """A 1-2-5 step that cuts ``span`` into about ``target`` intervals."""
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _axis(top: float, scale: float, *, plot_top: float, bottom: float, fmt: Callable[[float], str],
          tick_unit: float) -> list[str]:
    step = nice_step(top / tick_unit) * tick_unit
    parts = []
    for k in range(int(top / step) + 1):
        x = LEFT + k * step * scale
        parts.append(f'<line x1="{x:.1f}" y1="{plot_top}" x2="{x:.1f}" y2="{bottom}" stroke="#e3e3e3"/>')
        parts.append(_text(x, bottom + 16, fmt(k * step), anchor="middle", fill="#666", size=11))
    return parts


def _segments(terms: Sequence[Term], *, x0: float, y: float, scale: float,
              fmt: Callable[[float], str]) -> list[str]:
    parts, x = [], x0
    for term in terms:
        if term.value <= 0:
            continue
        tip = f"{term.label}: {fmt(term.value)} ({term.share:.0%})"
        parts.append(_rect(x, y, term.value * scale, BAR, term.color, tip))
        x += term.value * scale
    return parts


def _marker(x: float, label: str, *, top: float, bottom: float) -> str:
    line = (f'<line x1="{x:.1f}" y1="{top + 8}" x2="{x:.1f}" y2="{bottom}" stroke="#c0392b" '
            'stroke-width="2" stroke-dasharray="5 3"/>')
    return line + _text(x, top + 4, label, anchor="end" if x > WIDTH / 2 else "start", fill="#c0392b", size=11)


def _rect(x: float, y: float, w: float, h: float, color: str, tip: str, *, stroke: str = "none") -> str:
    return (f'<rect x="{x:.2f}" y="{y:.1f}" width="{max(w, 0.5):.2f}" height="{h}" fill="{color}" '
            f'stroke="{stroke}" stroke-width="0.75"><title>{escape(tip)}</title></rect>')


def _text(x: float, y: float, text: str, *, anchor: str = "start", fill: str = "#222", size: int = 12,
          weight: str = "400") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}" font-size="{size}" '
            f'font-weight="{weight}">{escape(text)}</text>')


def _svg(height: float, parts: list[str], *, label: str) -> str:
    return (f'<svg role="img" aria-label="{escape(label)}" '
            f'viewBox="0 0 {WIDTH} {height:.0f}" width="{WIDTH}" height="{height:.0f}" '
            f'font-family="system-ui, sans-serif">{"".join(parts)}</svg>')
