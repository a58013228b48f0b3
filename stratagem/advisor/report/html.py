"""``advise --format html``: one self-contained page (inline CSS and SVG, nothing fetched)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

from stratagem.advisor.search.advice import Advice
from stratagem.advisor.cost.estimate import Estimate
from stratagem.plan import Plan
from stratagem.advisor.report.content import (
    MEMORY_TERMS, OVERLAP_NOTE, TIME_TERMS, Term, step_note, excluded_lines, footer, format_seconds, memory_terms,
    nothing_fits_line, plan_columns, plan_row, time_terms, title, winner_line, workload_line,
)
from stratagem.advisor.report.schedule import simulate_pipeline
from stratagem.advisor.report.svg import (
    BACKWARD_COLOR, FORWARD_COLOR, IDLE_COLOR, drawable_plan, pipeline_timeline, stacked_bars,
)
from stratagem.units import format_bytes

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0; background: #fafafa; }
main { max-width: 940px; margin: 0 auto; padding: 24px 20px 48px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.sub { color: #555; margin: 0; }
.card { border: 1px solid #cfe3cf; background: #f3faf3; border-radius: 6px; padding: 10px 14px; margin: 16px 0; }
.card.bad { border-color: #e8b4b0; background: #fdf3f2; }
.card .big { font-size: 17px; font-weight: 600; }
.card p { margin: 6px 0 0; }
code { font: 13px ui-monospace, SFMono-Regular, Menlo, monospace; background: #f1f1f1; padding: 1px 4px;
       border-radius: 3px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e5e5e5; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; font-weight: 600; }
td.name, th.name { text-align: left; white-space: normal; }
tr.best td { font-weight: 600; background: #f3faf3; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 16px; font-size: 13px; margin: 4px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 5px;
          vertical-align: -1px; }
.split { display: grid; grid-template-columns: repeat(auto-fit, minmax(380px, 1fr)); gap: 8px 28px; }
.caption, footer { color: #666; font-size: 13px; }
svg { max-width: 100%; height: auto; display: block; }
"""


def render_html(advice: Advice) -> str:
    """The whole report as one HTML document."""
    sections = [_header(advice), _verdict(advice)]
    if advice.plans:
        sections += [_plans_table(advice), _list("Why this plan", advice.reasons), _figures(advice),
                     _breakdowns(advice.plans[0]), _timelines(advice.plans)]
    sections += [_list("Left out", excluded_lines(advice)), _list("Notes", advice.notes),
                 f"<footer><p>{escape(footer(advice))}</p></footer>"]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape('stratagem advise: ' + advice.profile.name)}</title><style>{CSS}</style></head>\n"
            f"<body><main>\n{chr(10).join(s for s in sections if s)}\n</main></body></html>\n")


def _header(advice: Advice) -> str:
    return (f"<header><h1>stratagem advise</h1><p class=\"sub\">{escape(title(advice))}</p>"
            f"<p class=\"sub\">{escape(workload_line(advice))}</p></header>")


def _verdict(advice: Advice) -> str:
    best = advice.best
    if best is None:
        fixes = f"<p><b>What would make it fit</b></p>{_items(advice.suggestions)}" if advice.suggestions else ""
        return (f'<section class="card bad"><div class="big">Nothing fits</div>'
                f"<p>{escape(nothing_fits_line(advice))}</p>{fixes}</section>")
    numbers = " · ".join(f"{h}: {escape(v)}" for h, v in zip(plan_columns(advice)[2:], plan_row(1, best)[2:]))
    return (f'<section class="card"><div class="big">Recommended: <code>{escape(best.plan.name)}</code></div>'
            f"<p>{numbers}</p></section>")


def _plans_table(advice: Advice) -> str:
    head = "".join(f'<th class="name">{escape(c)}</th>' if c == "plan" else f"<th>{escape(c)}</th>"
                   for c in plan_columns(advice))
    rows = []
    for rank, estimate in enumerate(advice.plans, 1):
        cells = plan_row(rank, estimate)
        tds = "".join(f'<td class="name"><code>{escape(c)}</code></td>' if i == 1 else f"<td>{escape(c)}</td>"
                      for i, c in enumerate(cells))
        attrs = ' class="best"' if rank == 1 else ""
        rows.append(f"<tr{attrs}>{tds}</tr>")
    return f"<h2>Top plans</h2><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _figures(advice: Advice) -> str:
    labelled = [(f"#{rank} {e.plan.name}", e) for rank, e in enumerate(advice.plans, 1)]
    capacity, device = advice.plans[0].capacity_bytes, advice.plans[0].device
    memory = stacked_bars([(label, memory_terms(e)) for label, e in labelled], label=f"memory per {device} by plan",
                          fmt=format_bytes,
                          tick_unit=2**30 if capacity >= 2**30 else 2**20,
                          marker=(capacity, f"usable {format_bytes(capacity)} per {device}"))
    time = stacked_bars([(label, time_terms(e)) for label, e in labelled], label="time per step by plan",
                        fmt=format_seconds)
    return (f"<h2>Memory per {device}</h2>{_legend(MEMORY_TERMS.values())}{memory}"
            '<p class="caption">Peak bytes on the fullest pipeline rank, '
            "against the memory a plan may use (device memory less a reserve).</p>"
            f"<h2>Time per step</h2>{_legend(TIME_TERMS.values())}{time}"
            '<p class="caption">Seconds per optimizer step, term by term; communication counts only '
            "where it is not overlapped with compute.</p>")


def _breakdowns(best: Estimate) -> str:
    memory = _term_table(f"Memory per {best.device}, winner", memory_terms(best), winner_line(best))
    time = _term_table("Time per step, winner", time_terms(best),
                       f"step {format_seconds(best.time.step_seconds)}{step_note(best)}")
    return f'<h2>Breakdown of <code>{escape(best.plan.name)}</code></h2><div class="split">{memory}{time}</div>'


def _term_table(heading: str, terms: Sequence[Term], total: str) -> str:
    details = any(t.detail for t in terms)
    rows = "".join(f'<tr><td class="name"><span class="swatch" style="background:{t.color}"></span>'
                   f"{escape(t.label)}</td><td>{escape(t.text)}</td><td>{t.share:.1%}</td>"
                   + (f'<td class="caption">{escape(t.detail)}</td>' if details else "") + "</tr>" for t in terms)
    extra = "<th>before overlap</th>" if details else ""
    note = f"<br>{escape(OVERLAP_NOTE)}" if details else ""
    return (f'<div><h3>{escape(heading)}</h3><table><thead><tr><th class="name">term</th><th>value</th>'
            f"<th>share</th>{extra}</tr></thead><tbody>{rows}</tbody></table>"
            f'<p class="caption">total: {escape(total)}{note}</p></div>')


def _timelines(plans: Sequence[Estimate]) -> str:
    distinct: dict[tuple, Plan] = {}
    for plan in (e.plan for e in plans if e.plan.pp > 1):
        distinct.setdefault((plan.pp, plan.pp_schedule, plan.pp_virtual, plan.microbatches), plan)
    if not distinct:
        return ""
    figures = [_timeline(plan, uid=str(i)) for i, plan in enumerate(distinct.values())]
    legend = _legend([("forward", FORWARD_COLOR), ("backward", BACKWARD_COLOR), ("idle: the bubble", IDLE_COLOR)])
    return ("<h2>Pipeline schedule</h2>" + legend + "".join(figures) +
            '<p class="caption">An illustration of the schedule\'s order, not a timing: every forward '
            "takes one unit, every backward two, sends are free; with virtual stages each chunk takes "
            "its share, odd virtual stages striped. Numbers are micro-batches; grey is the bubble.</p>")


def _timeline(plan: Plan, *, uid: str) -> str:
    """One schedule: heading with the bubble, the plan, the SVG (fewer micro-batches if many)."""
    drawn = drawable_plan(plan)
    virtual = f" × {plan.pp_virtual} virtual stages" if plan.pp_virtual > 1 else ""
    bubble = simulate_pipeline(plan).bubble_fraction
    heading = f"{plan.pp_schedule}, {plan.pp} ranks{virtual}, {plan.microbatches} micro-batches: bubble {bubble:.1%}"
    note = f"Plan <code>{escape(plan.name)}</code>."
    if drawn != plan:
        note += (f" Drawn with {drawn.microbatches} of its {plan.microbatches} micro-batches so the boxes stay "
                 f"legible (bubble {simulate_pipeline(drawn).bubble_fraction:.1%} as drawn).")
    return f'<h3>{escape(heading)}</h3><p class="caption">{note}</p>{pipeline_timeline(drawn, uid=uid)}'


def _legend(items: Iterable[tuple[str, str]]) -> str:
    spans = "".join(f'<span><span class="swatch" style="background:{color}"></span>{escape(label)}</span>'
                    for label, color in items)
    return f'<div class="legend">{spans}</div>'


def _list(heading: str, lines: Sequence[str]) -> str:
    return f"<h2>{escape(heading)}</h2>{_items(lines)}" if lines else ""


def _items(lines: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(line)}</li>" for line in lines) + "</ul>" if lines else ""
