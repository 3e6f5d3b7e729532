"""One self-contained HTML page describing a chosen plan.

Reads plain dicts (the plan and its predictions, rejected alternatives, stage map,
annotated block nodes) and a ready-made timeline SVG; writes nothing but a string.
The page uses inline CSS and inline SVG only: no scripts, no external resources.
Every piece of text is passed through `html.escape`; `timeline_svg` is embedded as is.
"""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from pathlib import Path

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "reserve")
MEMORY_COLORS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759",
                 "reserve": "#9c9c9c"}

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ccc; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.5em 0; max-width: 100%; }
.scroll { max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; font-size: 0.92em; }
td { overflow-wrap: break-word; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.summary th { width: 14em; }
code { font-size: 0.95em; }
.timeline { max-width: 100%; overflow-x: auto; }
svg { max-width: none; }
"""


def fmt_seconds(s: float) -> str:
    """18.76 -> '18.8 s', 0.486 -> '486 ms', 0.002 -> '2.0 ms', 5e-5 -> '50 us'."""
    if s >= 1.0:
        return f"{s:.1f} s"
    if s >= 0.01:
        return f"{s * 1e3:.0f} ms"
    if s >= 1e-4:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_gb(n: float) -> str:
    """Bytes as decimal gigabytes with two decimals: 52.5e9 -> '52.50 GB'."""
    return f"{n / 1e9:.2f} GB"


def fmt_percent(x: float) -> str:
    return f"{x * 100:.1f} %"


def _e(x: object) -> str:
    return html.escape(str(x))


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], numeric: Iterable[int] = ()) -> str:
    """An HTML table; every cell is escaped; columns listed in `numeric` align right."""
    numeric = set(numeric)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _section(heading: str, body: str) -> str:
    return f"<section><h2>{_e(heading)}</h2>\n{body}\n</section>"


def _degrees_text(degrees: dict) -> str:
    return " × ".join(f"{axis} {n}" for axis, n in degrees.items())


def _schedule_text(plan: dict) -> str:
    v = plan.get("virtual_stages", 1)
    return f"{plan['schedule']} ({v} virtual stages per device)" if v and v > 1 else str(plan["schedule"])


#: the simulator's step parts, in words
PART_WORDS = {"pipeline_s": "pipeline: compute, stage sends and bubbles", "dp_comm_s": "data-parallel communication",
              "optimizer_s": "optimizer step", "tp_comm_per_block_s": "tensor-parallel communication, one block",
              "block_fwd_s": "one block's forward", "block_bwd_s": "one block's backward",
              "p2p_s": "one stage-to-stage send", "ep_comm_s": "expert all-to-all", "compute_s": "compute",
              "comm_s": "communication"}


def plan_summary(plan: dict) -> str:
    """Key/value table of the chosen configuration and its predictions."""
    p = plan["predicted"]
    rows = [
        ("model", plan["model"]), ("cluster", f"{plan['cluster']} ({plan['devices']} devices)"),
        ("batch × seq", f"{plan['batch']} × {plan['seq']} ({plan['dtype']})"),
        ("degrees", _degrees_text(plan["degrees"])), ("ZeRO stage", plan["zero_stage"]),
        ("micro-batch × count", f"{plan['micro_batch_size']} × {plan['microbatches']}"),
        ("schedule", _schedule_text(plan)), ("recompute", plan["recompute"]),
        ("step time", fmt_seconds(p["step_time_s"])),
        ("model TFLOP/s per device", f"{p['tflops_per_device']:.1f}"),
    ]
    if "hw_tflops_per_device" in p:
        rows.append(("hardware TFLOP/s per device", f"{p['hw_tflops_per_device']:.1f}"))
    rows += [
        ("MFU", fmt_percent(p["mfu"])), ("peak memory per device", fmt_gb(p["peak_memory_bytes"])),
        ("pipeline bubble", fmt_percent(p["bubble_fraction"])),
        ("exposed communication", fmt_seconds(p["exposed_comm_s"])),
        ("planner time", fmt_seconds(plan["planner_time_s"])),
    ]
    if plan.get("search"):
        rows.append(("search", plan["search"]))
    if plan.get("configurations_scored") is not None:
        rows.append(("configurations scored", plan["configurations_scored"]))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    parts = p.get("parts_s", {})
    detail = _table(["part of the step", "time"], [(PART_WORDS.get(k, k), fmt_seconds(v)) for k, v in parts.items()],
                    numeric=[1]) if parts else ""
    return f'<table class="summary"><tbody>{body}</tbody></table>\n{detail}'


def memory_chart(memory_bytes: dict, budget_bytes: float | None = None, width: int = 640) -> str:
    """Inline SVG: one horizontal stacked bar of the memory parts (GB), a legend, the total,
    and a dashed vertical line at `budget_bytes` when given."""
    parts = [(k, float(memory_bytes.get(k, 0.0))) for k in MEMORY_PARTS]
    total = sum(v for _, v in parts)
    scale_max = max(total, budget_bytes or 0.0, 1.0) * 1.05
    x0, bar_y, bar_h, plot_w = 10, 24, 32, width - 20
    items = [f'<text x="{x0}" y="16" font-size="13">total {_e(fmt_gb(total))}</text>']
    x = float(x0)
    for name, v in parts:
        w = plot_w * v / scale_max
        items.append(f'<rect x="{x:.1f}" y="{bar_y}" width="{w:.1f}" height="{bar_h}" '
                     f'fill="{MEMORY_COLORS[name]}"><title>{_e(name)} {_e(fmt_gb(v))}</title></rect>')
        if w > 70:
            items.append(f'<text x="{x + 4:.1f}" y="{bar_y + 21}" font-size="12" fill="white">'
                         f'{_e(fmt_gb(v))}</text>')
        x += w
    if budget_bytes:
        bx = x0 + plot_w * budget_bytes / scale_max
        items.append(f'<line x1="{bx:.1f}" y1="{bar_y - 6}" x2="{bx:.1f}" y2="{bar_y + bar_h + 6}" '
                     'stroke="black" stroke-width="2" stroke-dasharray="4,3"/>')
        items.append(f'<text x="{bx - 4:.1f}" y="16" font-size="12" text-anchor="end">'
                     f'budget {_e(fmt_gb(budget_bytes))}</text>')
    items += _legend(parts, x0, bar_y + bar_h + 24)
    height = bar_y + bar_h + 36
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="memory breakdown">{"".join(items)}</svg>')


def _legend(parts: list[tuple[str, float]], x: int, y: int) -> list[str]:
    out = []
    for name, v in parts:
        label = f"{name} {fmt_gb(v)}"
        out.append(f'<rect x="{x}" y="{y - 10}" width="10" height="10" fill="{MEMORY_COLORS[name]}"/>'
                   f'<text x="{x + 14}" y="{y}" font-size="12">{_e(label)}</text>')
        x += 24 + 7 * len(label)
    return out


def stage_table(stages: list[dict]) -> str:
    if not stages:
        return "<p>single stage</p>"
    rows = [(s["stage"], s["device"], s["layers"], fmt_seconds(s["time_s"]), fmt_gb(s["memory_bytes"]))
            for s in stages]
    return _table(["stage", "device", "layers", "time", "memory"], rows, numeric=[0, 1, 3, 4])


#: a block row's keys and the words the page shows for them
BLOCK_COLUMNS = (("name", "graph node"), ("op", "operation"), ("module", "module"), ("shape", "output shape"),
                 ("placement", "placement on the tensor axis"), ("collective", "split strategy"))


def block_table(block_rows: list[dict]) -> str:
    if not block_rows:
        return "<p>no block nodes</p>"
    return _table([w for _, w in BLOCK_COLUMNS], [[r.get(k, "") for k, _ in BLOCK_COLUMNS] for r in block_rows])


ALTERNATIVE_HEADERS = ("data parallel", "tensor parallel", "pipeline stages", "expert parallel", "ZeRO stage",
                       "micro-batch", "schedule", "recompute", "step time", "memory per device",
                       "differs from the chosen plan", "why not chosen")
_COMPARED = (("dp", "data parallel"), ("tp", "tensor parallel"), ("pp", "pipeline stages"), ("ep", "expert parallel"))


def _differences(a: dict, chosen: dict | None) -> str:
    """What sets alternative ``a`` apart from the chosen plan, e.g. ``tensor parallel 4 → 8``."""
    if chosen is None:
        return ""
    out = []
    mine, theirs = a.get("degrees", {}), chosen.get("degrees", {})
    for key, words in _COMPARED:
        if mine.get(key, 1) != theirs.get(key, 1):
            out.append(f"{words} {theirs.get(key, 1)} → {mine.get(key, 1)}")
    for key, words in (("zero_stage", "ZeRO"), ("micro_batch_size", "micro-batch"),
                       ("microbatches", "micro-batches per step"), ("schedule", "schedule"),
                       ("virtual_stages", "virtual stages"), ("recompute", "recompute")):
        if key in a and key in chosen and a[key] != chosen[key]:
            out.append(f"{words} {chosen[key]} → {a[key]}")
    return ", ".join(out) or "same layout"


def alternatives_table(alternatives: list[dict], chosen: dict | None = None) -> str:
    """The other configurations, fastest first, one row each with what differs from the chosen
    plan (an empty table, headers kept, when there are none)."""
    rows = []
    for a in sorted(alternatives, key=lambda a: a["predicted"]["step_time_s"]):
        d, p = a["degrees"], a["predicted"]
        rows.append((d.get("dp", 1), d.get("tp", 1), d.get("pp", 1), d.get("ep", 1), a["zero_stage"],
                     a["micro_batch_size"], a["schedule"], a["recompute"], fmt_seconds(p["step_time_s"]),
                     fmt_gb(p["peak_memory_bytes"]), _differences(a, chosen), a.get("reason", "")))
    table = _table(ALTERNATIVE_HEADERS, rows, numeric=[0, 1, 2, 3, 4, 5, 8, 9])
    return table if rows else table + "\n<p>no alternatives recorded</p>"


def notes_list(notes: Sequence[str]) -> str:
    if not notes:
        return "<p>none</p>"
    return "<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"


def render_report(*, title: str, plan: dict, alternatives: list[dict], timeline_svg: str,
                  block_rows: list[dict], stages: list[dict], notes: Sequence[str] = ()) -> str:
    """The whole page as one HTML string (inline CSS and SVG, no scripts)."""
    memory = memory_chart(plan["predicted"]["memory_bytes"], plan.get("memory_budget_bytes"))
    sections = [
        _section("Plan", plan_summary(plan)),
        _section("Memory breakdown", memory),
        _section("Pipeline timeline", f'<div class="timeline">{timeline_svg}</div>'),
        _section("Stage map", stage_table(stages)),
        _section("Annotated graph of one block class", block_table(block_rows)),
        _section("Alternatives", alternatives_table(alternatives, plan)),
        _section("Notes", notes_list(notes)),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
            f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{_e(title)}</h1>\n" + "\n".join(sections) + "\n</body>\n</html>\n")


def write_report(path: str | Path, **kwargs) -> None:
    """Write `render_report(**kwargs)` to `path` as UTF-8."""
    Path(path).write_text(render_report(**kwargs), encoding="utf-8")
