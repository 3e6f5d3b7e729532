"""Pipeline schedules as a tiny IR, the standard schedules, and an event-level simulator.

IR. An :class:`Action` is one unit of work on one stage for one micro-batch: ``F`` (forward),
``B`` (backward; only its input-gradient half when the schedule splits backward), ``W`` (the
weight-gradient half), and the point-to-point ``SEND_*`` / ``RECV_*`` that
:meth:`Schedule.with_comm` derives from the compute order. A :class:`Schedule` is one ordered
program per device; global stage ``s`` lives on device ``s % p``. Text form, one line a device::

    d0: F0.0 F0.1 B0.0 B0.1
    d1: F1.0 B1.0 F1.1 B1.1

Generators, pure functions of (p, v, m): :func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`,
:func:`zero_bubble` (DualPipeV: :mod:`autopar.cost.pp_dualpipe`); :func:`make` picks one by name.

Simulator (:func:`simulate`). Each device runs its program in order, one compute action at a
time; an action starts once the device is free and its inputs are there:

    F(s, mb)   after F(s-1, mb) ends, + p2p[s-1]            (stage 0: at once)
    B(s, mb)   after F(s, mb) ends and B(s+1, mb) ends, + p2p[s]   (last stage: after its F)
    W(s, mb)   after B(s, mb) ends

p2p is paid only between stages on different devices. A transfer holds the link of its
(sender, receiver) device pair, one transfer at a time in the order the sender issues them,
and never the compute stream. The activations of (s, mb) are held from the start of F(s, mb)
to the end of B(s, mb) (of W(s, mb) when backward is split).

Bubble (Megatron-LM, Narayanan et al. 2021): ``(step - busy) / busy``, ``busy`` the compute
seconds of the busiest device. With uniform costs and no p2p, GPipe and 1F1B give
``(p-1)/m``; interleaved 1F1B gives ``(p-1)/(v*m)`` when f and b are a device's whole share of
the model, i.e. each of its v stages (chunks) costs f/v and b/v:
``StageCosts.uniform(p * v, f / v, b / v)``.
"""
from __future__ import annotations

import gc
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.core.errors import ConfigError
from autopar.core.mesh import stage_device

# torch's zero-bubble schedules run autograd twice per micro-batch (input gradients, then
# weight gradients from the saved graph); on this project's 2-core CPU that split backward
# costs ~35 % more than one whole backward (bench/pp.py: 135 ms vs 101 ms per 1F1B-sized
# step). The planners charge each device profile's own figure
# (:attr:`autopar.cost.hardware.DeviceSpec.zb_split_overhead`); this is the CPU's, the default
# where no device is known.
ZB_SPLIT_OVERHEAD = 0.35

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")

_ACTION_RE = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)\.(\d+)(?:([<>])(\d+))?")
_FLOW = {"F": (-1, +1), "B": (+1, -1)}      # kind -> (stage offset it reads from, writes to)


def _is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# ------------------------------------------------------------------------------ the IR

@dataclass(frozen=True, order=True)
class Action:
    """``kind`` (one of :data:`KINDS`) on global ``stage`` for micro-batch ``mb``.

    ``peer`` is the other stage of a SEND/RECV and None for compute. Text: ``F2.3`` (stage 2,
    micro-batch 3), ``B0.1``, ``W1.0``, ``SEND_F2.3>3``, ``RECV_F3.3<2``.
    """

    kind: str
    stage: int
    mb: int
    peer: int | None = None

    def __post_init__(self) -> None:
        # The hot path (the simulator makes one per transfer): plain type checks, no helpers.
        peer_ok = (self.peer is None if self.kind in COMPUTE_KINDS
                   else self.kind in KINDS and type(self.peer) is int and self.peer >= 0)
        if not (peer_ok and type(self.stage) is int and type(self.mb) is int
                and self.stage >= 0 and self.mb >= 0):
            raise ConfigError("invalid pipeline action", where="Action",
                              expected=f"kind in {KINDS}, int stage and mb >= 0, a peer stage exactly "
                                       "for SEND/RECV",
                              got=f"kind={self.kind!r} stage={self.stage!r} mb={self.mb!r} "
                                  f"peer={self.peer!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        text = f"{self.kind}{self.stage}.{self.mb}"
        if self.peer is None:
            return text
        return f"{text}{'>' if self.kind.startswith('SEND') else '<'}{self.peer}"

    @staticmethod
    def parse(text: str) -> Action:
        """The inverse of ``str(action)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        arrow = None if match is None or match[1] in COMPUTE_KINDS else (
            ">" if match[1].startswith("SEND") else "<")
        if match is None or match[4] != arrow:
            raise ConfigError(f"cannot parse pipeline action {text!r}", where="Action.parse",
                              expected="F2.3, B0.1, W1.0, SEND_F2.3>3 or RECV_F3.3<2", got=repr(text))
        peer = None if match[5] is None else int(match[5])
        return Action(match[1], int(match[2]), int(match[3]), peer)


@dataclass(frozen=True)
class Schedule:
    """One ordered program of actions per device. Stage ``s`` lives on device ``s % devices`` (or in a V,
    ``placement="v"``); ``overlapped`` F and B actions run paired, each hiding ``StageCosts.overlap_s``.

    ``programs`` normally holds compute actions only (F/B/W); :meth:`with_comm` adds the
    SEND/RECV each cross-device boundary implies. The simulator reads the compute order only.
    """

    name: str
    devices: int
    virtual: int
    microbatches: int
    split_backward: bool
    programs: tuple[tuple[Action, ...], ...]
    placement: str = "loop"
    overlapped: frozenset = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "programs", tuple(tuple(prog) for prog in self.programs))
        if self.placement not in ("loop", "v") or (self.placement == "v" and self.virtual != 2):
            raise ConfigError("a stage placement is 'loop', or 'v' with two stages per device",
                              where=f"Schedule {self.name!r}", got=f"{self.placement!r}, virtual={self.virtual}")
        for field in ("devices", "virtual", "microbatches"):
            if not _is_count(getattr(self, field), 1):
                raise ConfigError(f"schedule {field} must be a positive integer", where=f"Schedule.{field}",
                                  expected="an int >= 1", got=repr(getattr(self, field)))
        if len(self.programs) != self.devices:
            raise ConfigError("a schedule needs one program per device", where=f"Schedule {self.name!r}",
                              expected=f"{self.devices} programs", got=f"{len(self.programs)}")

    def stages(self) -> int:
        return self.devices * self.virtual

    def device_of(self, stage: int) -> int:
        return stage_device(stage, self.devices, self.placement)

    def compute_programs(self) -> tuple[tuple[Action, ...], ...]:
        """``programs`` without SEND/RECV."""
        return tuple(tuple(a for a in prog if a.is_compute) for prog in self.programs)

    def to_text(self) -> str:
        """One line per device: ``d0: F0.0 F0.1 B0.0 ...``."""
        return "\n".join(f"d{d}: {' '.join(map(str, prog))}".rstrip()
                         for d, prog in enumerate(self.programs))

    @staticmethod
    def from_text(text: str, *, name: str = "custom", virtual: int = 1,
                  split_backward: bool | None = None) -> Schedule:
        """Parse :meth:`to_text`. Devices are the ``dN:`` lines (0..p-1, each once);
        micro-batches are counted from the actions; ``split_backward`` defaults to "has a W"."""
        rows: dict[int, tuple[Action, ...]] = {}
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            head, sep, body = line.partition(":")
            head = head.strip()
            if not sep or not head[:1] == "d" or not head[1:].isdigit() or int(head[1:]) in rows:
                raise ConfigError("bad schedule line", where="Schedule.from_text",
                                  expected="'dN: A A ...', each device once", got=repr(line))
            rows[int(head[1:])] = tuple(Action.parse(tok) for tok in body.split())
        if sorted(rows) != list(range(len(rows))) or not any(rows.values()):
            raise ConfigError("schedule text must list devices d0..d{p-1} with some actions",
                              where="Schedule.from_text", got=f"devices {sorted(rows)}")
        actions = [a for prog in rows.values() for a in prog]
        split = any(a.kind == "W" for a in actions) if split_backward is None else split_backward
        return Schedule(name, len(rows), virtual, 1 + max(a.mb for a in actions), split,
                        tuple(rows[d] for d in range(len(rows))))

    def with_comm(self) -> Schedule:
        """A copy whose programs carry RECV_x before, and SEND_x after, each F/B whose input
        comes from, or output goes to, a stage on another device (idempotent)."""
        return Schedule(self.name, self.devices, self.virtual, self.microbatches, self.split_backward,
                        tuple(tuple(c for a in prog for c in self._with_comm(a))
                              for prog in self.compute_programs()), self.placement, self.overlapped)

    def _with_comm(self, a: Action) -> tuple[Action, ...]:
        if a.kind not in _FLOW:
            return (a,)
        here, (back, ahead) = self.device_of(a.stage), _FLOW[a.kind]
        src, dst = a.stage + back, a.stage + ahead
        crosses = [0 <= x < self.stages() and self.device_of(x) != here for x in (src, dst)]
        return ((Action(f"RECV_{a.kind}", a.stage, a.mb, src),) if crosses[0] else ()) + (a,) + (
            (Action(f"SEND_{a.kind}", a.stage, a.mb, dst),) if crosses[1] else ())

    def _misplaced(self, a: Action, d: int, kinds: tuple[str, ...], seen: set) -> str | None:
        """Why compute action ``a`` cannot sit in device d's program (None if it can)."""
        if (a.kind, a.stage, a.mb) in seen:
            return "is a duplicate"
        if a.stage >= self.stages():
            return f"names a stage outside 0..{self.stages() - 1}"
        if a.mb >= self.microbatches:
            return f"names a micro-batch outside 0..{self.microbatches - 1}"
        if a.kind not in kinds:
            return "is a W in a schedule that does not split backward"
        if self.device_of(a.stage) != d:
            return f"belongs on device {self.device_of(a.stage)}"
        return None

    def validate(self) -> None:
        """Each F, B (and W when split) of every stage and micro-batch exactly once, on its
        stage's device, SEND/RECV (if any) as :meth:`with_comm` derives them, and an order that
        runs to the end (simulated with unit costs). Raises :class:`ConfigError` otherwise."""
        simulate(self, StageCosts.uniform(self.stages(), 1.0, 2.0))

    def check_structure(self) -> tuple[tuple[Action, ...], ...]:
        """Every check of :meth:`validate` but the deadlock one; returns the compute programs."""
        where = f"schedule {self.name!r}"
        programs = self.compute_programs()
        if any(not a.is_compute for prog in self.programs for a in prog):
            derived = self.with_comm().programs
            for d in (d for d in range(self.devices) if derived[d] != self.programs[d]):
                raise ConfigError("SEND/RECV actions do not match the compute order",
                                  where=f"{where}, device {d}", fix="strip them and call with_comm()",
                                  expected=" ".join(map(str, derived[d]))[:300],
                                  got=" ".join(map(str, self.programs[d]))[:300])
        kinds = COMPUTE_KINDS if self.split_backward else ("F", "B")
        seen: set[tuple[str, int, int]] = set()
        for d, prog in enumerate(programs):
            for a in prog:
                problem = self._misplaced(a, d, kinds, seen)
                if problem:
                    raise ConfigError(f"action {a} on device {d} {problem}", where=f"{where}, device {d}",
                                      expected=f"each action once, on its stage's device ({self.placement})")
                seen.add((a.kind, a.stage, a.mb))
        if len(seen) < len(kinds) * self.stages() * self.microbatches:
            missing = [f"{k}{s}.{mb}" for s in range(self.stages()) for mb in range(self.microbatches)
                       for k in kinds if (k, s, mb) not in seen]
            raise ConfigError(f"{len(missing)} action(s) missing from the schedule", where=where,
                              expected=f"every {'/'.join(kinds)} of every stage and micro-batch once",
                              got="missing " + " ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""),
                              fix="add them to the program of the stage's device")
        return programs


# ------------------------------------------------------------------------------ generators

def _check_sizes(where: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if not _is_count(value, 1):
            raise ConfigError(f"{key} must be a positive integer", where=where, expected="an int >= 1",
                              got=repr(value))


def _program(*parts: Sequence[tuple[str, int, int]]) -> tuple[Action, ...]:
    return tuple(Action(kind, stage, mb) for part in parts for kind, stage, mb in part)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward, micro-batches in order."""
    _check_sizes("gpipe", p=p, m=m)
    return Schedule("gpipe", p, 1, m, False, tuple(
        _program([("F", d, i) for i in range(m)], [("B", d, i) for i in range(m)]) for d in range(p)))


def _one_f_one_b_order(p: int, d: int, m: int) -> tuple[list[int], list[tuple[str, int]]]:
    warmup = min(p - 1 - d, m)
    steady = [(k, i) for i in range(m - warmup) for k, i in (("F", warmup + i), ("B", i))]
    return list(range(warmup)), steady + [("B", i) for i in range(m - warmup, m)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): device d runs min(p-1-d, m) warm-up
    forwards, then alternates one forward and one backward, then the remaining backwards.
    At most min(p-d, m) micro-batches are held on device d."""
    _check_sizes("1f1b", p=p, m=m)
    programs = []
    for d in range(p):
        warmup, rest = _one_f_one_b_order(p, d, m)
        programs.append(_program([("F", d, i) for i in warmup], [(k, d, i) for k, i in rest]))
    return Schedule("1f1b", p, 1, m, False, tuple(programs))


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021) with v stages (chunks) per device:
    device d holds stages d, d+p, ..., d+(v-1)p.

    Forwards run in groups of p micro-batches per chunk, chunk 0 to v-1; backwards likewise,
    chunk v-1 to 0. Device d runs ``2(p-1-d) + (v-1)p`` warm-up forwards (at most all of
    them), then alternates one forward and one backward, then the remaining backwards: the
    order of torch's ``ScheduleInterleaved1F1B``, which the runtime runs (runtime/pp.py).
    Megatron-LM warms up with every forward when m == p; torch does not.
    """
    _check_sizes("interleaved_1f1b", p=p, v=v, m=m)
    if m % p:
        raise ConfigError("interleaved 1F1B needs the micro-batch count to be a multiple of the "
                          "pipeline degree", where="interleaved_1f1b", expected=f"m % {p} == 0",
                          got=f"m={m}", fix=f"use m={m + p - m % p} (or {m - m % p})" if m > p
                          else f"use m={p}")
    total = m * v

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    programs = []
    for d in range(p):
        warmup = min(2 * (p - 1 - d) + (v - 1) * p, total)
        order = [("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [("F", warmup + k), ("B", k)]
        order += [("B", k) for k in range(total - warmup, total)]
        steps = []
        for kind, k in order:
            chunk, mb = chunk_mb(k, kind == "B")
            steps.append((kind, chunk * p + d, mb))
        programs.append(_program(steps))
    return Schedule("interleaved", p, v, m, False, tuple(programs))


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of F and B,
    backward split into B (input grad, on the critical path) and W (weight grad, not).

    Device d holds back d weight-grads: W(j) runs right after the B that leaves more than d
    W's pending, and the last d run at the end, filling the cool-down bubbles. The B chain
    between devices then carries only B, and the bubble falls from 1F1B's (p-1)(F+B+W) to
    (p-1)(F+B-W) (Qi et al., section 3.1, for F = B = W; here whenever W <= B <= F and m >= p),
    and is below 1F1B's for any W > 0. Device d holds at most min(p, m) micro-batches - 1F1B's
    peak, on its device 0 - instead of 1F1B's min(p-d, m).
    """
    _check_sizes("zero_bubble", p=p, m=m)
    programs = []
    for d in range(p):
        warmup, rest = _one_f_one_b_order(p, d, m)
        steps, pending = [("F", d, i) for i in warmup], []
        for kind, i in rest:
            steps.append((kind, d, i))
            if kind == "B":
                pending.append(i)
                if len(pending) > d:
                    steps.append(("W", d, pending.pop(0)))
        programs.append(_program(steps, [("W", d, i) for i in pending]))
    return Schedule("zb", p, 1, m, True, tuple(programs))


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`); ``v`` is for "interleaved" only."""
    if name == "interleaved":
        return interleaved_1f1b(p, v, m)
    if name == "dualpipev":
        from autopar.cost.pp_dualpipe import dualpipe_v
        return dualpipe_v(p, m, v)
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}", where="pp_sim.make",
                          expected=", ".join(SCHEDULES), got=repr(name), fix="pick one of the expected names")
    if v != 1:
        raise ConfigError(f"schedule {name!r} has one stage per device", where="pp_sim.make",
                          expected="v=1 (or name='interleaved')", got=f"v={v}")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble}[name](p, m)


# ------------------------------------------------------------------------------ costs

def _floats(value, n: int | None, where: str) -> tuple[float, ...]:
    """``value`` (a number, or a sequence of ``n`` numbers) as a tuple of finite floats >= 0."""
    if isinstance(value, (int, float)):
        values = (float(value),) * (n if n is not None else 1)
    else:
        values = tuple(float(x) for x in value)
    if (n is not None and len(values) != n) or any(not math.isfinite(x) or x < 0 for x in values):
        raise ConfigError(f"bad stage costs in {where}", where=f"StageCosts.{where}",
                          expected=(f"{n} " if n is not None else "") + "finite numbers >= 0",
                          got=repr(value)[:200])
    return values


@dataclass(frozen=True)
class StageCosts:
    """Per-global-stage costs of one micro-batch, in seconds (and bytes).

    ``backward_s`` is the whole backward; ``weight_grad_s`` its weight-gradient share (W of a
    split schedule; default half), ``p2p_s[s]`` the time to move one activation or gradient
    across boundary s -> s+1 when those stages sit on different devices, ``activation_bytes[s]``
    what one micro-batch's forward leaves held on stage s until its backward ends, ``overlap_s[s]``
    what a paired F or B on stage s hides under its partner's compute (its exposed exchanges).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    weight_grad_s: tuple[float, ...] | None = None
    p2p_s: tuple[float, ...] | float = 0.0
    activation_bytes: tuple[float, ...] | float = 0.0
    overlap_s: tuple[float, ...] | float = 0.0

    def __post_init__(self) -> None:
        fwd = _floats(self.forward_s, None, "forward_s")
        bwd = _floats(self.backward_s, len(fwd), "backward_s")
        object.__setattr__(self, "forward_s", fwd)
        object.__setattr__(self, "backward_s", bwd)
        if self.weight_grad_s is not None:
            wgt = _floats(self.weight_grad_s, len(fwd), "weight_grad_s")
            if any(w > b for w, b in zip(wgt, bwd)):
                raise ConfigError("the weight-grad share exceeds the whole backward",
                                  where="StageCosts.weight_grad_s", expected="weight_grad_s <= backward_s",
                                  got=f"{wgt} > {bwd}")
            object.__setattr__(self, "weight_grad_s", wgt)
        for field in ("p2p_s", "activation_bytes", "overlap_s"):
            value = getattr(self, field)
            checked = _floats(value, None, field)
            object.__setattr__(self, field, checked[0] if isinstance(value, (int, float)) else checked)

    @staticmethod
    def uniform(stages: int, f: float, b: float, *, w: float | None = None, p2p: float = 0.0,
                act: float = 0.0) -> StageCosts:
        """Every stage alike: forward ``f``, whole backward ``b`` (of which ``w`` weight-grad)."""
        _check_sizes("StageCosts.uniform", stages=stages)
        return StageCosts((f,) * stages, (b,) * stages, None if w is None else (w,) * stages,
                          float(p2p), float(act))

    def per_stage(self, stages: int, split: bool) -> tuple[tuple[float, ...], ...]:
        """(forward, B, W, p2p per boundary, activation bytes) for ``stages`` stages; B is the whole
        backward unless ``split``, when it is backward minus the weight-grad share."""
        if len(self.forward_s) != stages:
            raise ConfigError("stage costs do not match the schedule", where="StageCosts.forward_s",
                              expected=f"{stages} stages", got=f"{len(self.forward_s)}")
        wgt = self.weight_grad_s or tuple(b / 2 for b in self.backward_s)
        b_part = tuple(b - w for b, w in zip(self.backward_s, wgt)) if split else self.backward_s
        return (self.forward_s, b_part, wgt if split else (0.0,) * stages,
                _floats(self.p2p_s, stages - 1, "p2p_s"), _floats(self.activation_bytes, stages, "activation_bytes"))


# ------------------------------------------------------------------------------ simulator

@dataclass(frozen=True, slots=True)
class Event:
    """``action`` ran on ``device`` from ``start`` to ``end`` (seconds). A transfer is one
    event on the sending device, its action a SEND_F / SEND_B."""

    device: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` measured (see the module notes for the bubble definition)."""

    step_time_s: float
    busy_s: tuple[float, ...]                  # per device, seconds of F/B/W compute
    bubble_fraction: float                     # (step - max(busy)) / max(busy)
    idle_fraction: tuple[float, ...]           # per device, 1 - busy / step
    peak_inflight: tuple[int, ...]             # per stage, most micro-batches held at once
    peak_activation_bytes: tuple[float, ...]   # per device, peak bytes held over its stages
    events: tuple[Event, ...]                  # compute (each device's in program order), then transfers
    schedule: Schedule
    extended_to: int | None = None             # set by cost/pp_steady.py: figures extended to this many micro-batches


class _Replay:
    """One run of a schedule: program counters, when each input arrives, the event log."""

    def __init__(self, schedule: Schedule, programs, costs: StageCosts) -> None:
        p, S, m = schedule.devices, schedule.stages(), schedule.microbatches
        self.schedule, self.programs, self.p, self.S, self.m = schedule, programs, p, S, m
        self.fwd, self.bwd, self.wgt, self.p2p, self.act = costs.per_stage(S, schedule.split_backward)
        self.release = "W" if schedule.split_backward else "B"
        self.paired, self.hide = schedule.overlapped, _floats(costs.overlap_s, S, "overlap_s")
        self.dev = [schedule.device_of(s) for s in range(S)]
        n = S * m
        self.f_in: list[float | None] = [0.0] * m + [None] * (n - m)    # activation arrives at (s, mb)
        self.g_in: list[float | None] = [None] * (n - m) + [0.0] * m    # output grad arrives at (s, mb)
        self.f_end: list[float | None] = [None] * n
        self.b_end: list[float | None] = [None] * n
        self.ptr, self.free, self.busy = [0] * p, [0.0] * p, [0.0] * p
        self.held, self.peak = [0] * S, [0] * S
        self.bytes_now, self.bytes_peak = [0.0] * p, [0.0] * p
        self.link_free: dict[tuple[int, int], float] = {}
        self.log: list[Event] = []
        self.transfers: list[tuple[int, float, float, str, int, int, int]] = []
        self.stack, self.queued = list(range(p)), [True] * p

    def run(self) -> None:
        while self.stack:
            d = self.stack.pop()
            self.queued[d] = False
            self._advance(d)
        if any(self.ptr[d] < len(self.programs[d]) for d in range(self.p)):
            self._deadlock()

    def _advance(self, d: int) -> None:
        """Run device d's program until an action's inputs are not there yet (the hot loop)."""
        prog, i, t, m, last = self.programs[d], self.ptr[d], self.free[d], self.m, self.S - 1
        f_in, g_in, f_end, b_end = self.f_in, self.g_in, self.f_end, self.b_end
        fwd, bwd, wgt, act, release = self.fwd, self.bwd, self.wgt, self.act, self.release
        held, peak, log, send = self.held, self.peak, self.log, self._send
        busy, now, top = 0.0, self.bytes_now[d], self.bytes_peak[d]
        while i < len(prog):
            a = prog[i]
            kind, s = a.kind, a.stage
            key = s * m + a.mb
            if kind == "F":
                ready, dur = f_in[key], fwd[s]
            elif kind == "B":
                ready, grad, dur = f_end[key], g_in[key], bwd[s]
                if grad is None or (ready is not None and grad > ready):
                    ready = grad
            else:
                ready, dur = b_end[key], wgt[s]
            if ready is None:
                break
            if self.paired and a in self.paired:      # its exchanges run under its partner's compute
                dur = max(dur - self.hide[s], 0.0)
            start = max(t, ready)
            t = start + dur
            busy += dur
            log.append(Event(d, start, t, a))
            if kind == "F":
                f_end[key] = t
                held[s] += 1
                peak[s] = max(peak[s], held[s])
                now += act[s]
                top = max(top, now)
                if s < last:
                    f_in[key + m] = send(d, a, s + 1, t)
            elif kind == "B":
                b_end[key] = t
                if s > 0:
                    g_in[key - m] = send(d, a, s - 1, t)
            if kind == release:
                held[s] -= 1
                now -= act[s]
            i += 1
        self.ptr[d], self.free[d] = i, t
        self.busy[d] += busy
        self.bytes_now[d], self.bytes_peak[d] = now, top

    def _send(self, d: int, a: Action, to: int, t: float) -> float:
        """When a's output, ready at t on device d, is there for stage ``to``; wakes its device."""
        dst = self.dev[to]
        if dst == d:
            return t
        start = max(t, self.link_free.get((d, dst), 0.0))
        end = start + self.p2p[min(a.stage, to)]
        self.link_free[(d, dst)] = end
        self.transfers.append((d, start, end, "SEND_" + a.kind, a.stage, a.mb, to))
        if not self.queued[dst]:
            self.queued[dst] = True
            self.stack.append(dst)
        return end

    def _deadlock(self) -> None:
        m, stuck = self.m, []
        for d in range(self.p):
            if self.ptr[d] < len(self.programs[d]):
                a = self.programs[d][self.ptr[d]]
                key = a.stage * m + a.mb
                need = (Action("F", a.stage - 1, a.mb) if a.kind == "F"
                        else Action("B", a.stage, a.mb) if a.kind == "W"
                        else Action("F", a.stage, a.mb) if self.f_end[key] is None
                        else Action("B", a.stage + 1, a.mb))
                stuck.append(f"device {d} at {a} waits for {need} (device {self.dev[need.stage]})")
        raise ConfigError(f"pipeline schedule {self.schedule.name!r} deadlocks: no device can make progress",
                          where=stuck[0].split(" waits")[0],
                          expected="an order in which every action's inputs are produced before it",
                          got="; ".join(stuck),
                          fix="reorder the programs so each device waits only on work that can finish")

    def result(self) -> SimResult:
        step = max(self.free)
        busiest = max(self.busy)
        events = self.log + [Event(d, start, end, Action(kind, s, mb, peer))
                             for d, start, end, kind, s, mb, peer in self.transfers]
        return SimResult(
            step_time_s=step, busy_s=tuple(self.busy),
            bubble_fraction=(step - busiest) / busiest if busiest > 0 else 0.0,
            idle_fraction=tuple(1 - b / step if step > 0 else 0.0 for b in self.busy),
            peak_inflight=tuple(self.peak), peak_activation_bytes=tuple(self.bytes_peak),
            events=tuple(events), schedule=self.schedule)


def simulate(schedule: Schedule, costs: StageCosts) -> SimResult:
    """Run ``schedule`` with ``costs`` (rules in the module notes). Checks the schedule's
    structure first; raises :class:`ConfigError` on a bad schedule or a deadlock, naming the
    stuck devices and actions. O(actions): each device resumes only when an input arrives."""
    # A long run makes a few hundred thousand small acyclic objects: pausing the cyclic
    # garbage collector meanwhile halves the time.
    paused = gc.isenabled()
    gc.disable()
    try:
        replay = _Replay(schedule, schedule.check_structure(), costs)
        replay.run()
        return replay.result()
    finally:
        if paused:
            gc.enable()
