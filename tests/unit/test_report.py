"""The advise report: terminal table, JSON, Markdown and HTML, on hand-made Advice; the
pipeline-schedule illustration against the bubble formula."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest
from rich.console import Console

from stratagem.advisor.search.advice import Advice
from stratagem.advisor.cost.estimate import Estimate, MemoryBreakdown, TimeBreakdown
from stratagem.advisor.hardware import parse_cluster
from stratagem.advisor.profile.cache import profile_spec
from stratagem.plan import Plan, Workload
from stratagem.advisor.report.render import _wrap_name, render_html, render_json, render_markdown, render_table
from stratagem.units import format_seconds
from stratagem.advisor.report.schedule import pipeline_order, simulate_pipeline
from stratagem.advisor.report.svg import pipeline_timeline

GiB = 2**30
PLANS = (
    Plan(tp=2, dp_shard=8, zero=3, sequence_parallel=True, activation_checkpointing="selective",
         micro_batch_size=2, grad_accum=2),
    Plan(tp=2, pp=4, dp_replicate=2, pp_schedule="interleaved-1f1b", pp_virtual=2, microbatches=8, grad_accum=2),
    Plan(pp=2, dp_shard=8, zero=1, pp_schedule="1f1b", microbatches=4, micro_batch_size=2),
)


def make_estimate(plan: Plan, *, gib: float = 40.0, step: float = 1.2, capacity_gib: float = 74.0) -> Estimate:
    """Plausible numbers: the terms are fixed shares of ``gib`` and ``step``."""
    memory = MemoryBreakdown(parameters=0.1 * gib * GiB, gradients=0.1 * gib * GiB, optimizer=0.2 * gib * GiB,
                             activations=0.5 * gib * GiB, buffers=0.1 * gib * GiB)
    bubble = 0.1 * step if plan.pp > 1 else 0.0
    time = TimeBreakdown(compute=0.7 * step - bubble, recompute=0.1 * step, dp_comm=0.05 * step,
                         tp_comm=0.1 * step, pp_comm=0.0, bubble=bubble, optimizer=0.05 * step, offload=0.0,
                         dp_comm_total=0.3 * step)
    return Estimate(plan=plan, memory=memory, time=time, capacity_bytes=capacity_gib * GiB, host_capacity_bytes=1e12,
                    throughput=64 * 64 / step, throughput_unit="tokens/s", mfu=0.41, device="GPU")


@pytest.fixture(scope="module")
def advice() -> Advice:
    profile = profile_spec("gpt2-tiny")
    return Advice(
        profile=profile, cluster=parse_cluster("2x8xH100-SXM-80GB:ib-ndr"),
        workload=Workload(global_batch_size=64, seq_len=profile.seq_len), target="any",
        plans=tuple(make_estimate(p, gib=60 - 10 * i, step=1.2 + 0.1 * i) for i, p in enumerate(PLANS)),
        reasons=("tp2+sp keeps tensor-parallel traffic on NVLink.", "The runner-up loses 8% to its bubble."),
        excluded={"not runnable by accelerate: pipeline parallelism (Accelerate trains none)": 412},
        notes=("cluster: figures from the catalog",), num_evaluated=1234, search_seconds=0.25,
    )


@pytest.fixture(scope="module")
def nothing_fits(advice: Advice) -> Advice:
    return replace(advice, plans=(), reasons=(), suggestions=("Use 4 nodes: FSDP over 32 ranks fits.",
                                                              "Lower --seq-len to 2048."))


def console_text(renderable, width: int) -> str:
    buffer = io.StringIO()
    Console(width=width, force_terminal=False, file=buffer).print(renderable)
    return buffer.getvalue()


@pytest.mark.parametrize("width", [80, 120])
def test_table_shows_plans_memory_reasons_and_fits_the_width(advice, width):
    text = console_text(render_table(advice), width)
    assert all(len(line.rstrip()) <= width for line in text.splitlines())
    assert "60.0 / 74.0 GiB" in text and "tokens/s" in text and "MFU" in text
    assert "tp2+sp keeps tensor-parallel traffic on NVLink." in text
    assert "412 plans — not runnable by accelerate" in text
    assert "Memory per GPU" in text and "Time per step" in text and "pipeline bubble" in text
    assert text.rstrip().endswith("evaluated 1,234 plans in 0.25 s")
    flat = re.sub(r"\s+", " ", text)
    assert PLANS[0].name.split()[0] in flat and "ckpt=selective" in flat


def test_a_compiled_winner_s_breakdown_keeps_every_figure_whole_at_80_columns(advice):
    """The compile time's note, long, goes under the time table: as a cell it squeezed the
    figures beside it to "5…" in an 80-column terminal (a Trainer's log)."""
    compiled = replace(advice.plans[0], plan=replace(PLANS[0], compile=True),
                       time=replace(advice.plans[0].time, compile_once=7.0))
    text = console_text(render_table(replace(advice, plans=(compiled, *advice.plans[1:]))), 80)
    assert "…" not in text and format_seconds(compiled.time.compute) in text
    assert "compiling its blocks once" in re.sub(r"\s+", " ", text)


def test_table_at_120_columns_keeps_plan_names_whole(advice):
    text = console_text(render_table(advice), 120)
    for plan in PLANS:
        assert plan.name in text


def test_wrap_name_breaks_after_a_dot_only_inside_long_words():
    name = "tp2·pp4x2(interleaved-1f1b)·dp2 mb=1 m=8 ga=16"
    assert _wrap_name(name, 40) == "tp2·pp4x2(interleaved-1f1b)·dp2 mb=1 m=8\nga=16"
    assert _wrap_name(name, 28) == "tp2·pp4x2(interleaved-1f1b)·\ndp2 mb=1 m=8 ga=16"
    assert _wrap_name(name, 20) == "tp2·\npp4x2(interleaved-1f1b)·\ndp2 mb=1 m=8 ga=16"


def test_nothing_fits_panel_gives_the_suggestions(nothing_fits):
    text = console_text(render_table(nothing_fits), 80)
    assert "Nothing fits" in text and "No plan fits gpt2-tiny" in text
    assert "Use 4 nodes: FSDP over 32 ranks fits." in text and "Lower --seq-len to 2048." in text
    assert "Top plans" not in text


def test_json_has_the_documented_keys(advice):
    data = json.loads(render_json(advice))
    assert data["model"]["parameters"] == advice.profile.num_params
    assert data["cluster"]["world_size"] == 16 and data["workload"]["global_batch_size"] == 64
    assert len(data["plans"]) == 3
    for entry, plan in zip(data["plans"], PLANS):
        assert Plan.from_dict(entry["plan"]) == plan
        assert entry["memory"]["total"] > 0 and entry["time"]["step_seconds"] > 0
        assert entry["tokens_per_second"] > 0 and 0 < entry["mfu"] < 1 and entry["fits"] is True
    assert data["excluded"] and data["num_evaluated"] == 1234


def test_markdown_has_the_plan_table_and_breakdowns(advice, nothing_fits):
    text = render_markdown(advice)
    assert "| # | plan | memory / GPU | step | tokens/s | MFU |" in text
    assert "| ---: | --- | ---: |" in text
    assert f"| 1 | {PLANS[0].name} | 60.0 / 74.0 GiB |" in text
    assert "| activations | 30.0 GiB | 50.0% |" in text and "before overlap" in text
    assert "## Nothing fits" in render_markdown(nothing_fits)


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def parse_html(text: str) -> _Collect:
    parser = _Collect()
    parser.feed(text)
    parser.close()
    return parser


def test_html_is_one_self_contained_page_with_plots(advice):
    page = render_html(advice)
    parsed = parse_html(page)
    assert parsed.tags.count("svg") == 2 + 2  # memory, time, and the two pipeline schedules
    assert {"script", "link", "img", "iframe"}.isdisjoint(parsed.tags)
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)", page))  # only in-page patterns
    text = "".join(parsed.text)
    assert PLANS[0].name in text and "usable 74.0 GiB per GPU" in text and "Nothing fits" not in text


def test_html_escapes_names_and_sentences(advice):
    evil = replace(advice, profile=replace(advice.profile, name="<script>x&y</script>"),
                   reasons=('a "<b>" reason',))
    page = render_html(evil)
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;x&amp;y&lt;/script&gt;" in page
    assert "script" not in parse_html(page).tags


def test_html_nothing_fits_has_no_plots(nothing_fits):
    page = render_html(nothing_fits)
    assert "Nothing fits" in page and "Lower --seq-len to 2048." in page and "<svg" not in page


def _boxes(svg: str) -> list[str]:
    return re.findall(r"<title>((?:forward|backward) of micro-batch \d+[^<]*)</title>", svg)


def test_1f1b_timeline_has_a_row_per_rank_and_two_boxes_per_microbatch():
    plan = Plan(pp=4, microbatches=6, pp_schedule="1f1b")
    svg = pipeline_timeline(plan)
    assert re.findall(r">rank (\d)<", svg) == ["0", "1", "2", "3"]
    assert len(_boxes(svg)) == 4 * 2 * 6
    timeline = simulate_pipeline(plan)
    for rank in range(4):
        assert sum(p.rank == rank for p in timeline.passes) == 2 * 6


@pytest.mark.parametrize("schedule, pp, m, v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 11, 1), ("gpipe", 4, 2, 1),
    ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 4, 4), ("interleaved-1f1b", 4, 4, 2),
])
def test_simulated_bubble_matches_the_ptdp_formula(schedule, pp, m, v):
    """Narayanan et al. 2021, §2.2: idle share (p − 1) / (m·v + p − 1) with backward = 2 × forward."""
    plan = Plan(pp=pp, microbatches=m, pp_schedule=schedule, pp_virtual=v)
    timeline = simulate_pipeline(plan)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / (m * v + pp - 1))
    assert len(timeline.passes) == 2 * pp * m * v


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    plan = Plan(pp=4, microbatches=8, pp_schedule="1f1b")
    for rank in range(4):
        in_flight, peak = 0, 0
        for kind, _, _ in pipeline_order(plan, rank):
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - rank
    gpipe = replace(plan, pp_schedule="gpipe")
    assert [k for k, _, _ in pipeline_order(gpipe, 0)] == ["F"] * 8 + ["B"] * 8


def test_interleaved_order_visits_every_chunk_of_every_microbatch():
    plan = Plan(pp=2, microbatches=4, pp_schedule="interleaved-1f1b", pp_virtual=2)
    order = pipeline_order(plan, 1)
    for kind in "FB":
        assert sorted((mb, c) for k, mb, c in order if k == kind) == [(mb, c) for mb in range(4) for c in range(2)]
    assert order[:2] == [("F", 0, 0), ("F", 1, 0)]


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (1.234, "1.23 s"), (12.34, "12.3 s"),
                                           (0.0412, "41.2 ms"), (0.0055, "5.50 ms"), (2.5e-4, "250 µs")])
def test_format_seconds(seconds, text):
    assert format_seconds(seconds) == text


def test_a_pipeline_winner_says_which_rank_its_terms_are(advice):
    """A pipeline's terms are its slowest rank's: the breakdown names it, and what it holds."""
    pipelined = make_estimate(PLANS[2])  # pp2, 1F1B over two stages: rank 1 holds the head
    for rank, holds in ((1, "with the head"), (0, "with the embedding")):
        paced = replace(pipelined, time=replace(pipelined.time, paced_rank=rank))
        text = re.sub(r"\s+", " ", render_markdown(replace(advice, plans=(paced, *advice.plans[:2]))))
        assert f"costed on pipeline rank {rank} of 2, {holds}: the slowest" in text
    assert "costed on pipeline rank" not in render_markdown(advice)  # its winner has no pipeline
