"""A pipeline schedule's simulated step for any micro-batch count, at the cost of a few hundred.

The event simulation (:func:`autopar.cost.pp_sim.simulate`) runs every action, so its time
and memory grow with the micro-batch count ``m`` (a schedule of ``m`` micro-batches holds
``2 m`` actions per stage). Past its warm-up a schedule repeats itself: each further period of
``k = 2 p`` micro-batches (whole groups of the interleaved schedule; 1F1B on uneven stages can
alternate between two step increments) adds the same seconds to the step and to every device's compute, and the same held
activations (none once warm, except under GPipe, which holds all ``m``). So :func:`run`
event-simulates ``m`` itself up to :data:`EVENT_MICROBATCHES_MAX`, and beyond it the closed form

    x(m) = x(m0) + (m - m0) / k * (x(m0 + k) - x(m0))

for x = step time, per-device compute, per-stage peak in-flight micro-batches and per-device
peak activation bytes, from two short event simulations at ``m0`` and ``m0 + k``, ``m0`` past
the warm-up. Its cost does not depend on ``m``. It is exact for uniform stages, and for uneven
ones once the short runs are past every transient: two nearly tied cycles of uneven stages
with point-to-point time can keep shifting the step increment for a few hundred micro-batches
(by 0.5 % in one random 8-device interleaved case), which is why ``m0`` is as long as the
event budget allows. tests/test_input_errors.py checks it against the whole event simulation.
cost/hybrid.py's ``_closed_form`` is the search's cheaper estimate of the same step (formulas
from the stage costs, no simulation at all).
"""
from __future__ import annotations

from autopar.cost.pp_sim import SimResult, StageCosts, make, simulate
from autopar.core.errors import ConfigError

EVENT_MICROBATCHES_MAX = 256    # beyond this many micro-batches per step: the closed form


def run(name: str, p: int, m: int, v: int, costs: StageCosts) -> SimResult:
    """Schedule ``name`` (gpipe, 1f1b, interleaved, zb) on ``p`` devices with ``v`` stages each
    and ``m`` micro-batches, costed by ``costs``: the event simulation's result when ``m`` is at
    most :data:`EVENT_MICROBATCHES_MAX`, else its linear extension (module docstring; the
    result's ``events`` are then empty and ``schedule`` is the short run's)."""
    if type(m) is not int or m < 1:
        raise ConfigError("micro-batch count must be a positive integer", where="pp_steady.run",
                          expected="an int >= 1", got=repr(m))
    k, m0 = _period(p, v)
    if m <= max(EVENT_MICROBATCHES_MAX, m0 + k):   # m0 + k > the budget only for p > 42
        return simulate(make(name, p, m, v), costs)
    if name == "interleaved" and m % p:     # let the generator say why
        make(name, p, m % p, v)
    m0 += (m - m0) % k                      # whole periods from m0 to m
    a, b = simulate(make(name, p, m0, v), costs), simulate(make(name, p, m0 + k, v), costs)
    periods = (m - m0) / k

    def ext(x: float, y: float) -> float:
        return x + periods * (y - x)

    step = ext(a.step_time_s, b.step_time_s)
    busy = tuple(ext(x, y) for x, y in zip(a.busy_s, b.busy_s))
    busiest = max(busy)
    return SimResult(step_time_s=step, busy_s=busy,
                     bubble_fraction=(step - busiest) / busiest if busiest > 0 else 0.0,
                     idle_fraction=tuple(1 - x / step if step > 0 else 0.0 for x in busy),
                     peak_inflight=tuple(round(ext(x, y)) for x, y in zip(a.peak_inflight, b.peak_inflight)),
                     peak_activation_bytes=tuple(ext(x, y) for x, y in zip(a.peak_activation_bytes,
                                                                             b.peak_activation_bytes)),
                     events=(), schedule=a.schedule, extended_to=m)


def _period(p: int, v: int) -> tuple[int, int]:
    """``(k, m0)``: ``k = 2 p`` micro-batches hold a whole number of periods of every schedule
    (1F1B on uneven stages can alternate between two step increments; interleaved works in
    groups of ``p``); ``m0``, a multiple of ``k``, is past every schedule's warm-up
    (interleaved 1F1B's reaches ``2(p - 1) + (v - 1) p`` forwards of chunks) and as long as
    the event simulation's own budget allows, so slow transients have settled."""
    k = 2 * p
    return k, k * max(4, v + 3, EVENT_MICROBATCHES_MAX // k)
