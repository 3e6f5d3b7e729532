"""Strategy solver on the tensor axis.

Objective: minimise, per training step, the sum over ops of the roofline time of the
chosen strategy's local work (forward + backward) plus the alpha-beta time of every
conversion the choice implies (a forward collective where a value's placement differs
from what its consumer needs, a backward collective where the gradient the consumer emits
differs from what the producer needs), plus ``mem_weight`` seconds per byte of
per-rank parameter/gradient/optimizer state.
Constraints: per-rank state bytes within ``memory_budget`` - met by raising ``mem_weight``
until the plan fits (or reporting that it cannot); parameters in ``forced`` stored as the
user forced them (only dims the axis divides are ever offered, forced or not).

Method: dynamic programming over the graph in topological order. A state is the
placement of every live value plus the conversions already paid for it (one conversion
per value and target placement: three column-parallel consumers of one replicated value
share one backward all-reduce). Repeated blocks are solved once: the first member of the
largest block class is solved for each placement of the values carried from one member to
the next, and the outer DP steps over all members at once with that cost times their count
(the real model's where the graph holds fewer copies, ``GraphInfo.block_copies``; not with
forced placements, which may differ from one member to the next).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.fx as fx

from autopar.cost.cluster import Cluster
from autopar.cost.comm import collective_time
from autopar.cost.op_cost import node_seconds
from autopar.core.errors import AutoparInternalError
from autopar.passes.memory import OPTIMIZER_STATE
from autopar.core.meta import block_copies, evaluate, graph_info, info
from autopar.passes.sharding import is_decision, strategies, tensor_inputs, written_in_place
from autopar.core.placement import REP, Shard, Spec, Strategy, comm_bytes, shard, transition

log = logging.getLogger("autopar.solver")
BEAM = 64  # states kept per step (lowest cost first); see solve()


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """What the tensor-axis solver needs to price choices."""

    n: int
    cluster: Cluster
    mesh_axes: tuple[tuple[str, int], ...]
    axis: str = "tp"
    sizes: dict[str, int] = field(default_factory=dict)
    dtype: str = "fp32"
    optimizer: str = "adamw"
    memory_budget: float | None = None   # bytes of parameter+gradient+optimizer state per rank
    mem_weight: float = 0.0              # seconds charged per byte of that state
    # nodes that must stay replicated on this axis (True), or may only take the strategies a
    # returned predicate accepts (the experts' weights and matmuls under expert parallelism)
    pinned: Callable[[fx.Node], Any] | None = None
    forced: dict[str, str] = field(default_factory=dict)  # placeholder name -> the placement the user forced
    # sequence parallelism: None lets the cost choose; False keeps every activation whole along
    # its sequence dim; True leaves no activation that has a sequence dim whole on every rank
    sequence: bool | None = None


@dataclass
class Solution:
    """The chosen strategy per decision node, with the predicted costs."""

    strategies: dict[str, Strategy]        # node name -> strategy (placeholders included)
    compute_s: float
    comm_s: float
    state_bytes: float
    conversions: list[tuple[str, str, str, float]]  # (node, from spec, to spec, seconds)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


class Pricer:
    """Prices strategies and conversions for one graph and configuration."""

    def __init__(self, gm: fx.GraphModule, cfg: SolverConfig) -> None:
        self.cfg = cfg
        self.gm = gm
        state_per_param = 4 + 4 + 4 * OPTIMIZER_STATE.get(cfg.optimizer, 2)
        self.state_factor = state_per_param / 4  # state bytes per byte of fp32 parameter
        self._strategies: dict[fx.Node, list[Strategy]] = {}
        # Parameters and buffers read by exactly one op are decided with that op.
        self.folded = {n for n in gm.graph.nodes if is_folded(n)}
        self.written = written_in_place(gm)   # kept replicated, no conversions between (passes/sharding.py)
        self._compute: dict[tuple[fx.Node, Strategy], tuple[float, float]] = {}
        self._convert: dict[tuple, float] = {}
        self._bytes: dict[tuple[fx.Node, int], float] = {}

    def storage_for(self, param: fx.Node, need: Spec) -> Strategy:
        """How to store a parameter read by one op only: as that op needs it when that is a
        storable placement (a partial one is stored whole and masked)."""
        for s in self.options(param):
            if s.outputs[0].value == need.value:
                return s
        return self.options(param)[0]

    def bytes_of(self, node: fx.Node, i: int = 0) -> float:
        if (node, i) not in self._bytes:
            vals = info(node).values
            self._bytes[node, i] = float(evaluate(vals[i].nbytes, self.cfg.sizes)) if i < len(vals) else 0.0
        return self._bytes[node, i]

    def options(self, node: fx.Node) -> list[Strategy]:
        if node not in self._strategies:
            opts = (placeholder_options(node, self.cfg)
                    if node.op == "placeholder" else strategies(node, self.cfg.n, self.cfg.sizes))
            if node.name in self.cfg.forced:     # checked divisible before solving (autopar/build/checks.py)
                opts = [s for s in opts if str(s.outputs[0].value) == self.cfg.forced[node.name]]
            if self.cfg.sequence is not None and node.op != "placeholder":
                opts = sequence_filter(node, opts, self.cfg.sequence)
            pinned = True if node in self.written else self.cfg.pinned(node) if self.cfg.pinned is not None else False
            if callable(pinned):
                opts = [s for s in opts if pinned(s)] or opts[:1]
            self._strategies[node] = opts[:1] if pinned is True else opts
        return self._strategies[node]

    def compute(self, node: fx.Node, s: Strategy) -> tuple[float, float]:
        """(seconds, state bytes) of running ``node`` with ``s``."""
        if (node, s) not in self._compute:
            self._compute[node, s] = self._price(node, s)
        return self._compute[node, s]

    def _price(self, node: fx.Node, s: Strategy) -> tuple[float, float]:
        rec = info(node)
        if node.op == "placeholder":
            if rec.kind != "param" or not rec.trainable:
                return 0.0, 0.0
            nbytes = self.bytes_of(node) * self.state_factor
            return 0.0, nbytes / self.cfg.n if isinstance(s.outputs[0].value, Shard) else nbytes
        fwd, bwd = node_seconds(node, self.cfg.sizes, self.cfg.cluster.device, self.cfg.dtype, strategy=s,
                                n=self.cfg.n)
        return fwd + bwd, 0.0

    def convert(self, node: fx.Node, idx: int, src: Spec, dst: Spec) -> float:
        """Seconds to hand value ``idx`` of ``node`` placed ``src`` to a consumer needing ``dst``."""
        key = (node, idx, src, dst)
        if key not in self._convert:
            self._convert[key] = self._conversion(node, idx, src, dst)
        return self._convert[key]

    def _conversion(self, node: fx.Node, idx: int, src: Spec, dst: Spec) -> float:
        full = self.bytes_of(node, idx)
        total = self._step_time(transition(src.value, dst.value), full)
        if info(node).requires_grad:
            total += self._step_time(transition(dst.grad, src.grad), full)
        return total

    def _step_time(self, step, full: float) -> float:
        nbytes = comm_bytes(step, full, self.cfg.n)
        if not nbytes:
            return 0.0
        if step.kind == "all_to_all":
            nbytes /= self.cfg.n
        return collective_time(step.kind, nbytes, self.cfg.cluster, self.cfg.mesh_axes, self.cfg.axis)


SEQ = "seq"   # the size name of the sequence dim (``dims=({0: "batch", 1: "seq"},)``)


def sequence_dims(node: fx.Node) -> list[set[int]]:
    """Per tensor output of ``node``, the dims whose size involves the ``seq`` size."""
    return [{d for d, size in enumerate(v.shape) if any(sym.name == SEQ for sym in getattr(size, "free_symbols", ()))}
            for v in info(node).values]


def sequence_filter(node: fx.Node, opts: list[Strategy], split: bool) -> list[Strategy]:
    """The strategies of ``node`` that the sequence-parallel choice ``split`` allows (all of
    them where none would be left: an op that cannot run otherwise keeps its options).

    ``split=False`` drops strategies that split an output or its gradient along a sequence dim;
    ``split=True`` drops those that leave an output with a sequence dim replicated."""
    dims = sequence_dims(node)
    if not any(dims):
        return opts

    def along_seq(s: Strategy) -> bool:
        return any(isinstance(p, Shard) and p.dim in dims[i]
                   for i, o in enumerate(s.outputs) if i < len(dims) for p in (o.value, o.grad))

    def whole(s: Strategy) -> bool:
        return any(dims[i] and o.value == REP.value for i, o in enumerate(s.outputs) if i < len(dims))

    kept = [s for s in opts if not (along_seq(s) if not split else whole(s))]
    return kept or opts


def placeholder_options(node: fx.Node, cfg: SolverConfig) -> list[Strategy]:
    """Parameters and buffers may be stored replicated or split along any dim that divides;
    the user's inputs arrive whole on every rank."""
    rec = info(node)
    out = [Strategy("replicate", (), (REP,), 1.0)]
    if rec.kind in ("param", "buffer") and cfg.n > 1 and rec.value is not None:
        for d, size in enumerate(rec.value.shape):
            size = evaluate(size, cfg.sizes)
            if size % cfg.n == 0 and size >= cfg.n:
                out.append(Strategy(f"shard{d}", (), (shard(d),), 1.0 / cfg.n))
    return out


# ------------------------------------------------------------------------ the DP

@dataclass
class _Block:
    """A block class collapsed into one DP step."""

    members: list[list[fx.Node]]           # per member, its nodes in graph order
    copies: int                            # how many the real model has (more when captured with fewer)
    carry_in: list[fx.Node]                # values member 0 takes from the previous member's role
    carry_out: list[fx.Node]               # the last member's values used after the block
    shared: list[fx.Node]                  # other outside values the members read
    plans: dict[tuple[Spec, ...], tuple[float, float, float, dict[str, Strategy]]] = field(default_factory=dict)
    # sigma -> (compute s, comm s, state bytes, strategies of every member's nodes)


class _DP:
    """Frontier dynamic programme over a sequence of steps (nodes or blocks)."""

    def __init__(self, pricer: Pricer, steps: list, uses: dict[fx.Node, int]) -> None:
        self.p = pricer
        self.steps = steps
        self.uses_left = uses  # consumers (steps) still to come, per value
        self._opt_cache: dict[fx.Node, list] = {}

    def run(self, start: dict, finals: dict[fx.Node, tuple[Spec, ...]]) -> tuple[float, dict[str, Strategy], float, float, float]:
        """``start`` maps live values to their specs; ``finals`` the specs the values left at
        the end must be converted to. Returns (cost, strategies, compute, comm, state)."""
        # a state is the set of (live value, (specs, conversions paid)): a frozenset keys it without sorting
        init = frozenset((v, (tuple(s), _NONE_PAID)) for v, s in start.items())
        layers = [{init: (0.0, None, None, 0.0, 0.0, 0.0)}]
        remaining = dict(self.uses_left)
        for step in self.steps:
            log.debug("step %s: %d states", _name(step), len(layers[-1]))
            nxt: dict = {}
            dead = _consumed(step, remaining)
            for key, (cost, *_rest, c_s, m_s, b_s) in layers[-1].items():
                before = dict(key)
                after = dict(before)
                for v in dead:
                    after.pop(v, None)
                for choice, extra, out_specs, dc, dm, db in self._expand(step, before):
                    state = dict(after)
                    _apply_paid(state, extra)
                    if out_specs is not None:
                        for v, specs in out_specs.items():
                            state[v] = (specs, _NONE_PAID)
                    k2 = frozenset(state.items())
                    total = cost + dc + dm + db * self.p.cfg.mem_weight
                    if k2 not in nxt or nxt[k2][0] > total:
                        nxt[k2] = (total, key, choice, c_s + dc, m_s + dm, b_s + db)
            if not nxt:
                raise AutoparInternalError(f"tensor-axis solver found no strategy at {_name(step)}")
            if len(nxt) > BEAM:
                nxt = dict(sorted(nxt.items(), key=lambda kv: kv[1][0])[:BEAM])
            layers.append(nxt)
        best_key, best, best_cost = None, None, math.inf
        for key, val in layers[-1].items():
            state = dict(key)
            end = sum(self._final_cost(v, state[v], finals[v]) for v in finals if v in state)
            if val[0] + end < best_cost:
                best_key, best, best_cost = key, val, val[0] + end
        end_comm = best_cost - best[0]
        chosen: dict[str, Strategy] = {}
        key = best_key
        for i in range(len(self.steps), 0, -1):
            _, prev, choice, *_ = layers[i][key]
            if isinstance(choice, dict):
                chosen.update(choice)
            key = prev
        return best_cost, chosen, best[3], best[4] + end_comm, best[5]

    def _final_cost(self, v: fx.Node, have: tuple, need: tuple[Spec, ...]) -> float:
        specs, paid = have
        return sum(self.p.convert(v, i, s, t) for i, (s, t) in enumerate(zip(specs, need))
                   if s != t and (i, t) not in paid)

    def _expand(self, step, state: dict):
        if isinstance(step, _Block):
            yield from self._expand_block(step, state)
            return
        node: fx.Node = step
        if node.target is _GETITEM:
            src, idx = node.args[0], node.args[1]
            yield {}, [], {node: (state[src][0][idx],)}, 0.0, 0.0, 0.0
            return
        for s, comp, nbytes, comm0, choice, live in self._options(node):
            comm, extra = comm0, []
            for u, need in live:
                specs, paid = state[u]
                have = specs[0]
                if have != need and (0, need) not in paid and (u, need) not in extra:
                    comm += self.p.convert(u, 0, have, need)
                    extra.append((u, need))
            yield choice, extra, {node: s.outputs}, comp, comm, nbytes

    def _options(self, node: fx.Node) -> list:
        """Per strategy of ``node``, the part of its price no state changes: compute, the
        stored parameters' bytes and conversions, and the live inputs left to convert."""
        if node in self._opt_cache:
            return self._opt_cache[node]
        ins = tensor_inputs(node) if node.op != "placeholder" else []
        out = []
        for s in self.p.options(node):
            comp, nbytes = self.p.compute(node, s)
            comm, choice, live = 0.0, {node.name: s}, []
            for u, need in zip(ins, s.inputs):
                if u in self.p.folded:
                    stored = self.p.storage_for(u, need)
                    choice[u.name] = stored
                    nbytes += self.p.compute(u, stored)[1]
                    comm += self.p.convert(u, 0, stored.outputs[0], need)
                else:
                    live.append((u, need))
            out.append((s, comp, nbytes, comm, choice, live))
        self._opt_cache[node] = out
        return out

    def _expand_block(self, block: _Block, state: dict):
        for sigma, (b_comp, b_comm, b_state, plan) in block.plans.items():
            comm, extra = 0.0, []
            for u, need in list(zip(block.carry_in, sigma)) + [(u, REP) for u in block.shared]:
                specs, paid = state[u]
                if specs[0] != need and (0, need) not in paid and (u, need) not in extra:
                    comm += self.p.convert(u, 0, specs[0], need)
                    extra.append((u, need))
            outs = {v: (sigma[block.carry_out.index(v)] if v in block.carry_out else REP,)
                    for v in block.carry_out}
            yield plan, extra, outs, b_comp, b_comm + comm, b_state


_GETITEM = __import__("operator").getitem


_NONE_PAID: frozenset = frozenset()     # conversions paid for a value: a set, so equal states are equal keys


def _apply_paid(state: dict, extra: list) -> None:
    for u, need in extra:
        specs, paid = state.get(u, (None, None))
        if specs is not None:
            state[u] = (specs, paid | {(0, need)})


def _name(step) -> str:
    return step.name if isinstance(step, fx.Node) else f"block of {len(step.members)} members"


def _consumed(step, remaining: dict[fx.Node, int]) -> list[fx.Node]:
    """Values whose last consumer is ``step`` (updates ``remaining``)."""
    reads = _reads(step)
    dead = []
    for v in reads:
        remaining[v] -= 1
        if remaining[v] == 0:
            dead.append(v)
    return dead


def _reads(step) -> list[fx.Node]:
    if isinstance(step, _Block):
        return list(dict.fromkeys(step.carry_in + step.shared))
    if step.target is _GETITEM:
        return [step.args[0]]
    return [u for u in tensor_inputs(step) if not is_folded(u)] if step.op != "placeholder" else []


def is_folded(node: fx.Node) -> bool:
    """A parameter or buffer read by exactly one op: decided together with that op."""
    return (node.op == "placeholder" and info(node).kind in ("param", "buffer")
            and len(node.users) == 1 and is_decision(next(iter(node.users))))


def count_uses(steps: Sequence, extra_reads: Sequence[fx.Node] = ()) -> dict[fx.Node, int]:
    uses: dict[fx.Node, int] = {}
    for step in steps:
        for v in _reads(step):
            uses[v] = uses.get(v, 0) + 1
    for v in extra_reads:
        uses[v] = uses.get(v, 0) + 1
    return uses


# ------------------------------------------------------------------------ steps and blocks

def _steps(nodes: Sequence[fx.Node], folded: set[fx.Node]) -> list[fx.Node]:
    """Decision nodes and tensor getitems in order, each placeholder just before its first
    reader (so it is live for as short a stretch as possible); folded parameters are
    decided with their reader."""
    out: list[fx.Node] = []
    placed: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder":
            continue
        if not (is_decision(node) or (node.target is _GETITEM and info(node).values)):
            continue
        for u in _reads(node):
            if u.op == "placeholder" and u not in placed and u not in folded:
                placed.add(u)
                out.append(u)
        out.append(node)
    return out


def _chain_order(steps: list[fx.Node]) -> list[fx.Node]:
    """Reorder steps (still topologically) to finish one chain before starting the next:
    always take the ready step that reads the most recently produced value. This keeps few
    values live at once, which is what the DP's state count grows with."""
    index = {s: i for i, s in enumerate(steps)}
    waiting = {s: {u for u in _reads(s) if u in index} for s in steps}
    users: dict[fx.Node, list[fx.Node]] = {s: [] for s in steps}
    for s, deps in waiting.items():
        for u in deps:
            users[u].append(s)
    done_at: dict[fx.Node, int] = {}
    ready = [s for s in steps if not waiting[s]]
    out: list[fx.Node] = []
    while ready:
        best = max(ready, key=lambda s: (max((done_at[u] for u in _reads(s) if u in done_at), default=-1),
                                         -index[s]))
        ready.remove(best)
        done_at[best] = len(out)
        out.append(best)
        for s in users[best]:
            waiting[s].discard(best)
            if not waiting[s]:
                ready.append(s)
    if len(out) != len(steps):
        raise AutoparInternalError("tensor-axis solver: step order has a cycle")
    return out


def _find_block(gm: fx.GraphModule, steps: list[fx.Node]) -> tuple[_Block, int, int] | None:
    """The largest block class as one collapsible step: (block, first, last step index)."""
    classes = sorted(graph_info(gm).block_classes, key=lambda c: -block_copies(gm, c) * c.nodes_per_member)
    for cls in classes:
        if len(cls.members) < 2:
            continue
        owner = {i: _member_of(step, cls.members, steps) for i, step in enumerate(steps)}
        idx = [i for i, m in owner.items() if m is not None]
        if not idx or any(owner[i] is None for i in range(idx[0], idx[-1] + 1)):
            continue
        members = [_chain_order([steps[i] for i in idx if owner[i] == m]) for m in cls.members]
        block = _carries(members, set(steps[idx[-1] + 1:]), block_copies(gm, cls))
        if block is not None:
            return block, idx[0], idx[-1]
    return None


def _member_of(step: fx.Node, members: Sequence[str], steps: list[fx.Node]) -> str | None:
    if step.op != "placeholder":
        return info(step).block_member if info(step).block_member in members else None
    users = {info(u).block_member for u in step.users if u in steps or is_decision(u)}
    return users.pop() if len(users) == 1 and next(iter(users)) in members else None


def _carries(members: list[list[fx.Node]], after: set[fx.Node], copies: int) -> _Block | None:
    """Work out what flows between members; None if the members do not line up."""
    first, second, last = members[0], members[1], members[-1]
    if any(len(m) != len(first) or list(map(_op, m)) != list(map(_op, first)) for m in members):
        return None
    pos0 = {v: j for j, v in enumerate(first)}
    inside = {v for m in members for v in m}
    carry_in, carry_src, shared = [], [], []
    for j, (s0, s1) in enumerate(zip(first, second)):
        for a0, a1 in zip(_reads(s0), _reads(s1)):
            if a1 in pos0:                         # member 1 reads member 0: a carry
                if a0 in pos0:
                    return None
                if a0 not in carry_in:
                    carry_in.append(a0)
                    carry_src.append(a1)
                elif carry_src[carry_in.index(a0)] is not a1:
                    return None
            elif a0 not in pos0:                   # read from outside: the same value, or one per
                if a1 in inside:                   # member (gemma2's masks, sliding / full in turn)
                    return None
                shared.extend(a for a in (a0, a1) if a not in shared)
    for m in members[2:]:
        shared.extend(a for s in m for a in _reads(s) if a not in inside and a not in shared)
    pos_last = {v: j for j, v in enumerate(last)}
    carry_out = [v for v in last if any(u in after for u in v.users) or _is_output_arg(v)]
    src_pos = [pos0[c] for c in carry_src]
    if any(pos_last[v] not in src_pos for v in carry_out) or not carry_in:
        return None
    block = _Block(members=members, copies=copies, carry_in=carry_in, carry_out=carry_out, shared=shared)
    block.carry_src = carry_src  # type: ignore[attr-defined]
    return block


def _op(step: fx.Node) -> object:
    """What a step does, for lining members up: its op (a parameter step by kind, not by name)."""
    return "placeholder" if step.op == "placeholder" else step.target


def _is_output_arg(v: fx.Node) -> bool:
    return any(u.op == "output" for u in v.users)


def _spec_choices(node: fx.Node, cfg: SolverConfig) -> list[Spec]:
    out = [REP]
    rec = info(node)
    if cfg.n > 1 and rec.value is not None:
        for d, size in enumerate(rec.value.shape):
            size = evaluate(size, cfg.sizes)
            if size % cfg.n == 0 and size >= cfg.n:
                out.append(shard(d))
    return out


def _solve_block(block: _Block, pricer: Pricer) -> None:
    """Price member 0 for every placement of the carried values; copy to all members; the
    cost is one member's times the real model's copies (:attr:`_Block.copies`)."""
    import itertools
    first = block.members[0]
    choices = [_spec_choices(v, pricer.cfg) for v in block.carry_in]
    for sigma in itertools.product(*choices):
        start = {v: (s,) for v, s in zip(block.carry_in, sigma)}
        start.update({v: (REP,) for v in block.shared})
        finals = {src: (s,) for src, s in zip(block.carry_src, sigma)}  # type: ignore[attr-defined]
        dp = _DP(pricer, first, count_uses(first, list(finals)))
        _, chosen, comp, comm, state = dp.run(start, finals)
        k = block.copies
        plan = {}
        for member in block.members:
            for s0, s in zip(first, member):
                if s0.name in chosen:
                    plan[s.name] = chosen[s0.name]
                for u0, u in zip(tensor_inputs(s0), tensor_inputs(s)):
                    if is_folded(u0) and u0.name in chosen:
                        plan[u.name] = chosen[u0.name]
        block.plans[tuple(sigma)] = (comp * k, comm * k, state * k, plan)


def solve(gm: fx.GraphModule, cfg: SolverConfig) -> Solution:
    """The cheapest strategy for every node of an analysed graph (see the module docstring)."""
    if cfg.memory_budget is None:
        return _solve_once(gm, cfg)
    sol = _solve_once(gm, cfg)
    # Charge memory in seconds: start where the whole state is worth the whole step time,
    # then raise the price a hundredfold at a time until the plan fits.
    weight = max(sol.time_s, 1e-9) / max(sol.state_bytes, 1.0)
    unreachable = cfg.memory_budget < _leanest_bound(gm, cfg)
    if unreachable:        # nothing fits: straight to the leanest plan the last raise would reach
        leanest = _solve_once(gm, _with_weight(cfg, weight * 100 ** 3))
        sol = leanest if leanest.state_bytes < sol.state_bytes else sol
    for _ in range(0 if unreachable else 4):
        if sol.state_bytes <= cfg.memory_budget:
            break
        smaller = _solve_once(gm, _with_weight(cfg, weight))
        if smaller.state_bytes < sol.state_bytes:
            sol = smaller
        weight *= 100
    if sol.state_bytes > cfg.memory_budget:
        log.warning("tensor-axis plan needs %.3g GB of state per rank, over the budget of %.3g GB",
                    sol.state_bytes / 1e9, cfg.memory_budget / 1e9)
    return sol


def _leanest_bound(gm: fx.GraphModule, cfg: SolverConfig) -> float:
    """A lower bound on any plan's state bytes per rank: every parameter split ``n`` ways."""
    pricer = Pricer(gm, cfg)
    total = sum(pricer.compute(n, placeholder_options(n, cfg)[0])[1] for n in gm.graph.nodes if n.op == "placeholder")
    return total / cfg.n


def _with_weight(cfg: SolverConfig, weight: float) -> SolverConfig:
    from dataclasses import replace
    return replace(cfg, mem_weight=weight)


def _solve_once(gm: fx.GraphModule, cfg: SolverConfig) -> Solution:
    pricer = Pricer(gm, cfg)
    nodes = list(gm.graph.nodes)
    steps = _steps(nodes, pricer.folded)
    found = None if cfg.forced else _find_block(gm, steps)   # forced placements differ per layer
    outer: list = list(steps)
    if found is not None:
        block, i0, i1 = found
        _solve_block(block, pricer)
        outer = _chain_order(steps[:i0]) + [block] + _chain_order(steps[i1 + 1:])
    output = nodes[-1]
    finals = {v: (REP,) * len(info(v).values) for v in output.all_input_nodes if info(v).values}
    dp = _DP(pricer, outer, count_uses(outer, list(finals)))
    _, chosen, comp, comm, state = dp.run({}, finals)
    for node in nodes:  # placeholders nobody reads stay replicated
        if node.op == "placeholder" and node.name not in chosen and info(node).values:
            chosen[node.name] = placeholder_options(node, cfg)[0]
    log.info("tensor-axis solver: %d decisions, compute %.3g s, comm %.3g s, state %.3g GB/rank",
             len(chosen), comp, comm, state / 1e9)
    return Solution(strategies=chosen, compute_s=comp, comm_s=comm, state_bytes=state, conversions=[])
