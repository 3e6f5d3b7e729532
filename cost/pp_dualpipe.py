"""DualPipeV as a schedule of the simulator (:mod:`autopar.cost.pp_sim`): torch's own order, its
V placement and its overlapped pairs (runtime/pp_overlap.py runs the pairs at once)."""
from __future__ import annotations

from autopar.core.errors import ConfigError
from autopar.cost.pp_sim import Action, Schedule


def dualpipe_v(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, the V-shaped single-copy variant of DualPipe): two stages per
    device in a V (device d holds stages d and 2p-1-d), forward of one micro-batch paired with
    backward of another in the steady state, zero-bubble weight steps in warm-up and cool-down.
    The order is torch's ``ScheduleDualPipeV`` (which the runtime runs): asked of torch itself.
    A whole backward is B then W here; each pair's F and B are in ``overlapped``."""
    if v != 2:
        raise ConfigError("DualPipeV has two stages per device", where="dualpipe_v", expected="v=2", got=f"v={v}")
    for key, value in (("p", p), ("m", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be a positive integer", where="dualpipe_v", expected="an int >= 1",
                              got=repr(value))
    if m < 2 * p:
        raise ConfigError("DualPipeV needs at least as many micro-batches as stages", where="dualpipe_v",
                          expected=f"m >= {2 * p}", got=f"m={m}", fix=f"use m={2 * p} or more")
    from types import SimpleNamespace
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType as T
    kind = {T.FORWARD: ("F",), T.FULL_BACKWARD: ("B", "W"), T.BACKWARD_INPUT: ("B",), T.BACKWARD_WEIGHT: ("W",)}
    programs, paired = [], set()
    for d in range(p):
        steps = []
        for a in ScheduleDualPipeV._calculate_single_rank_operations(SimpleNamespace(pp_group_size=p,
                                                                                     _n_microbatches=m), d):
            subs = a.sub_actions or (a,)
            for sub in subs:
                for k in kind[sub.computation_type]:
                    steps.append(Action(k, sub.stage_index, sub.microbatch_index))
                    if a.sub_actions and k in ("F", "B"):
                        paired.add(steps[-1])
        programs.append(tuple(steps))
    return Schedule("dualpipev", p, 2, m, True, tuple(programs), "v", frozenset(paired))


__all__ = ["dualpipe_v"]
