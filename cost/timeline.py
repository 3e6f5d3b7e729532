"""An SVG timeline of one simulated pipeline step (:func:`autopar.cost.pp_sim.simulate`).

One row per device, time on the x axis in milliseconds. Forward, backward and weight-grad
work are coloured rectangles (a device's later virtual stages in lighter shades), each
labelled with its micro-batch when wide enough and carrying a ``<title>`` tooltip; transfers
are thin bars under the sending device's row (activations above, gradients below); idle
time is the row's grey background. Plain SVG text, standard library only.
"""
from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from autopar.cost.pp_sim import Event, SimResult

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b", "SEND_F": "#7f7f7f", "SEND_B": "#b279a2"}
LEGEND = (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("SEND_F", "send activation"),
          ("SEND_B", "send grad"), ("idle", "idle"))
IDLE = "#ececec"
LEFT, RIGHT, TOP, TITLE_H = 56, 24, 12, 26        # margins, pixels
ROW_H, COMM_H, ROW_GAP = 26, 3, 8                 # a row: the compute band, two comm lanes, a gap
ROW_PITCH = ROW_H + 2 * (COMM_H + 1) + ROW_GAP
AXIS_H, LEGEND_H = 44, 24
FONT = "font-family='sans-serif'"


def _tick_ms(span_ms: float) -> float:
    """A 1-2-5 step giving about eight ticks over ``span_ms``."""
    raw = span_ms / 8
    base = 10 ** math.floor(math.log10(raw))
    return next(k * base for k in (1, 2, 5, 10) if k * base >= raw)


def _digits(tick_ms: float) -> int:
    """Decimals that tell ticks apart at this tick size (tooltips get two more)."""
    return min(6, max(0, -math.floor(math.log10(tick_ms))))


class _Canvas:
    """Pixel geometry of one timeline."""

    def __init__(self, result: SimResult, title: str, width: int) -> None:
        self.devices = result.schedule.devices
        self.span = result.step_time_s if result.step_time_s > 0 else 1.0
        self.plot_w = max(width - LEFT - RIGHT, 100)
        self.width = LEFT + self.plot_w + RIGHT
        self.top = TOP + (TITLE_H if title else 0)
        self.axis_y = self.top + self.devices * ROW_PITCH
        self.height = self.axis_y + AXIS_H + LEGEND_H
        self.tick = _tick_ms(self.span * 1e3)
        self.digits = _digits(self.tick) + 2

    def x(self, seconds: float) -> float:
        return LEFT + seconds / self.span * self.plot_w

    def row(self, device: int) -> float:
        return self.top + device * ROW_PITCH

    def ms(self, seconds: float) -> str:
        return f"{seconds * 1e3:.{self.digits}f}"


def _compute_rect(c: _Canvas, e: Event, virtual: int) -> str:
    a = e.action
    x0, x1 = c.x(e.start), c.x(e.end)
    y, w = c.row(e.device), max(x1 - x0, 0.5)
    chunk = a.stage // c.devices
    opacity = 1.0 - 0.45 * chunk / (virtual - 1) if virtual > 1 else 1.0
    tip = f"{a.kind} stage {a.stage} mb {a.mb}: {c.ms(e.start)}-{c.ms(e.end)} ms"
    out = (f"<rect x='{x0:.2f}' y='{y}' width='{w:.2f}' height='{ROW_H}' fill='{COLOURS[a.kind]}' "
           f"fill-opacity='{opacity:.2f}' stroke='white' stroke-width='0.5'>"
           f"<title>{escape(tip)}</title></rect>")
    label = str(a.mb)
    if w >= 6.5 * len(label) + 4:
        out += (f"<text x='{(x0 + x1) / 2:.2f}' y='{y + ROW_H / 2 + 4}' font-size='10' {FONT} "
                f"text-anchor='middle' fill='white' pointer-events='none'>{label}</text>")
    return out


def _comm_bar(c: _Canvas, e: Event) -> str:
    a = e.action
    lane = 0 if a.kind.endswith("F") else 1
    y = c.row(e.device) + ROW_H + 1 + lane * (COMM_H + 1)
    x0 = c.x(e.start)
    tip = (f"{a.kind} stage {a.stage} mb {a.mb} to stage {a.peer}: "
           f"{c.ms(e.start)}-{c.ms(e.end)} ms")
    return (f"<rect x='{x0:.2f}' y='{y}' width='{max(c.x(e.end) - x0, 0.5):.2f}' height='{COMM_H}' "
            f"fill='{COLOURS.get(a.kind, '#7f7f7f')}'><title>{escape(tip)}</title></rect>")


def _rows(c: _Canvas, result: SimResult) -> list[str]:
    out = []
    for d in range(c.devices):
        y = c.row(d)
        busy = result.busy_s[d] * 1e3
        out.append(f"<text class='row-label' x='{LEFT - 8}' y='{y + ROW_H / 2 + 4}' font-size='12' {FONT} "
                   f"text-anchor='end'>d{d}<title>device {d}: {busy:.3f} ms busy, "
                   f"{result.idle_fraction[d]:.1%} idle</title></text>")
        out.append(f"<rect x='{LEFT}' y='{y}' width='{c.plot_w}' height='{ROW_H}' fill='{IDLE}'/>")
    return out


def _axis(c: _Canvas) -> list[str]:
    y = c.axis_y
    out = [f"<line x1='{LEFT}' y1='{y}' x2='{LEFT + c.plot_w}' y2='{y}' stroke='black'/>"]
    digits = _digits(c.tick)
    for i in range(int(c.span * 1e3 / c.tick + 1e-9) + 1):
        t_ms = i * c.tick
        x = c.x(t_ms / 1e3)
        out.append(f"<line x1='{x:.2f}' y1='{y}' x2='{x:.2f}' y2='{y + 5}' stroke='black'/>")
        out.append(f"<text x='{x:.2f}' y='{y + 17}' font-size='10' {FONT} text-anchor='middle'>"
                   f"{t_ms:.{digits}f}</text>")
    out.append(f"<text x='{LEFT + c.plot_w / 2}' y='{y + 34}' font-size='11' {FONT} "
               f"text-anchor='middle'>time (ms)</text>")
    return out


def _legend(c: _Canvas, kinds: set[str]) -> list[str]:
    out, x, y = [], LEFT, c.axis_y + AXIS_H
    for kind, text in LEGEND:
        if kind != "idle" and kind not in kinds:
            continue
        fill = IDLE if kind == "idle" else COLOURS[kind]
        out.append(f"<rect x='{x}' y='{y}' width='12' height='12' fill='{fill}' stroke='#999' "
                   f"stroke-width='0.5'/>")
        out.append(f"<text x='{x + 16}' y='{y + 10}' font-size='11' {FONT}>{text}</text>")
        x += 28 + 7 * len(text)
    return out


def timeline_svg(result: SimResult, *, title: str = "", width: int = 1200) -> str:
    """A self-contained SVG of ``result``'s step: a row per device (``d0``, ``d1``, ...),
    time in ms on the x axis, a legend, and a tooltip on every rectangle."""
    c = _Canvas(result, title, width)
    sched = result.schedule
    header = (f"<svg xmlns='http://www.w3.org/2000/svg' width='{c.width}' height='{c.height}' "
              f"viewBox='0 0 {c.width} {c.height}'>")
    parts = [header, f"<rect width='{c.width}' height='{c.height}' fill='white'/>"]
    if title:
        parts.append(f"<text x='{LEFT}' y='{TOP + 16}' font-size='14' font-weight='bold' {FONT}>"
                     f"{escape(title)}</text>")
    parts += _rows(c, result)
    parts += [_compute_rect(c, e, sched.virtual) if e.action.is_compute else _comm_bar(c, e)
              for e in result.events]
    parts += _axis(c)
    parts += _legend(c, {e.action.kind for e in result.events})
    summary = (f"{sched.name}: p={sched.devices} v={sched.virtual} m={sched.microbatches}, "
               f"step {result.step_time_s * 1e3:.3f} ms, bubble {result.bubble_fraction:.1%}")
    parts.insert(1, f"<desc>{escape(summary)}</desc>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_timeline(result: SimResult, path: str | Path, *, title: str = "", width: int = 1200) -> None:
    """Write :func:`timeline_svg` of ``result`` to ``path`` (UTF-8)."""
    Path(path).write_text(timeline_svg(result, title=title, width=width), encoding="utf-8")

