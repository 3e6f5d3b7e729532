"""The HTML report: sections present, values shown, text escaped, file written."""
from __future__ import annotations

import copy
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from autopar.cli.report import fmt_gb, fmt_seconds, memory_chart, render_report, write_report

TIMELINE = "<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'></svg>"
HEADINGS = ["Plan", "Memory breakdown", "Pipeline timeline", "Stage map",
            "Annotated graph of one block class", "Alternatives", "Notes"]


def example_plan() -> dict:
    return {"model": "gpt3-175b", "cluster": "128x8 a100-sxm-80gb", "devices": 1024, "batch": 1536, "seq": 2048,
            "dtype": "fp16", "degrees": {"dp": 32, "tp": 4, "pp": 8, "ep": 1}, "zero_stage": 2,
            "micro_batch_size": 1, "microbatches": 48, "schedule": "interleaved", "virtual_stages": 2,
            "recompute": "none", "planner_time_s": 1.8,
            "predicted": {"step_time_s": 18.76, "tflops_per_device": 176.3, "hw_tflops_per_device": 176.3,
                          "mfu": 0.565, "peak_memory_bytes": 52.5e9,
                          "memory_bytes": {"params": 11.2e9, "grads": 0.35e9, "optimizer": 2.1e9,
                                           "activations": 38.9e9},
                          "bubble_fraction": 0.075, "exposed_comm_s": 0.486,
                          "parts_s": {"pipeline_s": 18.2, "dp_comm_s": 0.5, "optimizer_s": 0.02,
                                      "tp_comm_per_block_s": 0.002, "block_fwd_s": 0.004,
                                      "block_bwd_s": 0.009}}}


def alternative(dp: int, tp: int, pp: int, step: float, memory: float, reason: str) -> dict:
    alt = copy.deepcopy(example_plan())
    alt["degrees"] = {"dp": dp, "tp": tp, "pp": pp, "ep": 1}
    alt["predicted"]["step_time_s"] = step
    alt["predicted"]["peak_memory_bytes"] = memory
    alt["reason"] = reason
    return alt


def report_kwargs(**overrides) -> dict:
    kw = dict(
        title="gpt3-175b on 1024 A100",
        plan=example_plan(),
        alternatives=[alternative(64, 2, 8, 21.3, 71.0e9, "slower: tp 2 leaves pipeline too deep"),
                      alternative(128, 8, 1, 15.0, 95.1e9, "over memory budget by 15 GB")],
        timeline_svg=TIMELINE,
        block_rows=[
            {"name": "attn_qkv", "op": "aten.mm", "module": "layers.0.attn.qkv", "shape": "[1, 2048, 9216]",
             "placement": "Shard(2)", "collective": ""},
            {"name": "attn_out", "op": "aten.mm", "module": "layers.0.attn.out", "shape": "[1, 2048, 12288]",
             "placement": "Partial", "collective": "all_reduce(tp)"},
            {"name": "mlp_fc1", "op": "aten.mm", "module": "layers.0.mlp.fc1", "shape": "[1, 2048, 12288]",
             "placement": "Shard(2)", "collective": ""},
        ],
        stages=[{"stage": i, "device": i, "layers": f"{12 * i}-{12 * i + 11}", "time_s": 2.3 + 0.1 * i,
                 "memory_bytes": 50e9 + i * 1e9} for i in range(3)],
        notes=["interleaved schedule chosen for the smaller bubble"],
    )
    kw.update(overrides)
    return kw


class Headings(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.tags: set[str] = set()
        self._in = False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self._in = self._in or tag == "h2"
        if tag == "h2":
            self.headings.append("")

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in = False

    def handle_data(self, data):
        if self._in:
            self.headings[-1] += data


@pytest.fixture
def page() -> str:
    return render_report(**report_kwargs())


def test_html_parser_sees_all_section_headings(page):
    parser = Headings()
    parser.feed(page)
    parser.close()
    assert parser.headings == HEADINGS
    assert {"html", "head", "style", "body", "svg", "table"} <= parser.tags
    assert "script" not in parser.tags


def test_page_is_well_formed_xml():
    root = ET.fromstring(render_report(**report_kwargs()).split("\n", 1)[1])
    assert root.tag == "html"


def test_plan_summary_shows_predictions(page):
    for text in ["18.8 s", "56.5 %", "176.3", "486 ms", "7.5 %", "1.8 s", "52.50 GB", "1 × 48",
                 "dp 32 × tp 4 × pp 8 × ep 1", "interleaved", "gpt3-175b", "2.0 ms"]:
        assert text in page, text


def test_alternatives_stages_blocks_and_timeline(page):
    assert "slower: tp 2 leaves pipeline too deep" in page
    assert "over memory budget by 15 GB" in page
    assert "21.3 s" in page and "95.10 GB" in page
    for layers in ["0-11", "12-23", "24-35"]:
        assert f"<td>{layers}</td>" in page
    for name in ["attn_qkv", "attn_out", "mlp_fc1"]:
        assert f"<td>{name}</td>" in page
    assert "all_reduce(tp)" in page
    assert TIMELINE in page
    assert "interleaved schedule chosen for the smaller bubble" in page


def test_text_is_escaped():
    alt = alternative(1, 1, 1, 1.0, 1e9, "<script>alert(1)</script>")
    page = render_report(**report_kwargs(alternatives=[alt], title="a < b", notes=["x & y"]))
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &lt; b" in page and "x &amp; y" in page


def test_empty_stages_blocks_alternatives_notes():
    page = render_report(**report_kwargs(stages=[], block_rows=[], alternatives=[], notes=[]))
    assert "single stage" in page
    parser = Headings()
    parser.feed(page)
    assert parser.headings == HEADINGS


def test_memory_chart_parts_total_and_budget():
    mem = example_plan()["predicted"]["memory_bytes"]
    svg = memory_chart(mem)
    for label in ["params 11.20 GB", "grads 0.35 GB", "optimizer 2.10 GB", "activations 38.90 GB",
                  "total 52.55 GB"]:
        assert label in svg, label
    assert "<line" not in svg
    with_budget = memory_chart(mem, 80e9)
    assert "<line" in with_budget and "budget 80.00 GB" in with_budget
    ET.fromstring(with_budget)
    plan = example_plan()
    plan["memory_budget_bytes"] = 80e9
    assert "budget 80.00 GB" in render_report(**report_kwargs(plan=plan))


@pytest.mark.parametrize("seconds, text", [(18.76, "18.8 s"), (0.486, "486 ms"), (0.002, "2.0 ms"),
                                           (1.0, "1.0 s"), (0.02, "20 ms")])
def test_fmt_seconds(seconds, text):
    assert fmt_seconds(seconds) == text


def test_fmt_gb():
    assert fmt_gb(52.5e9) == "52.50 GB"


def test_write_report(tmp_path):
    path = tmp_path / "report.html"
    kw = report_kwargs(title="plan — ünïcode")
    write_report(path, **kw)
    text = path.read_text(encoding="utf-8")
    assert text == render_report(**kw)
    assert "plan — ünïcode" in text


def test_alternatives_are_sorted_and_say_what_differs():
    chosen = example_plan()
    slow = alternative(64, 2, 8, 21.3, 71.0e9, "slower")
    fast = alternative(128, 8, 1, 15.0, 95.1e9, "over memory")
    page = render_report(**report_kwargs(alternatives=[slow, fast]))
    assert page.index("15.0 s") < page.index("21.3 s")                       # fastest first
    assert f"tensor parallel {chosen['degrees']['tp']} → 8" in page and "pipeline stages 8 → 1" in page
    assert "<th>differs from the chosen plan</th>" in page and "<th>op</th>" not in page   # words, not keys


def test_wide_tables_scroll_inside_the_page():
    page = render_report(**report_kwargs())
    assert page.count('<div class="scroll"><table>') >= 3          # every data table in its own scroller
    assert ".scroll { max-width: 100%; overflow-x: auto; }" in page and "td { overflow-wrap: break-word; }" in page
