"""Pipeline stages: where to cut the captured graph, and the per-stage graphs.

A *cut position* ``k`` is a place in the graph's topological order: ops before it go to one
stage, ops from it on to the next. What crosses a cut is every value made before it and read
after it (an activation, or a user input read later), sent forward per micro-batch and its
gradient sent back. Values computed from parameters, buffers and constants alone (a
transposed weight, the RoPE tables) never cross: every stage that reads one recomputes it
from its own copy of the parameters. A parameter read on several stages (GPT's tied
embedding and head) is held by each of them; the runtime sums its gradient over them.

:func:`plan_cuts` chooses the cuts by dynamic programming over the candidate positions:
stages are balanced on forward + backward seconds per micro-batch (from the cost model) plus
the time to send the cut's activations, subject to a per-stage memory budget (parameters,
gradients and optimizer state, plus the activations the schedule keeps in flight), and among
equally balanced choices the one with the smallest activations crossing wins. Only positions
whose crossing bytes are small (within 2x of the smallest; more when that leaves too few)
are candidates, which keeps the search to block boundaries and the few places like them.

:func:`split_stages` builds one ``fx.GraphModule`` per stage whose placeholders are the
stage's parameters and buffers (original ``state_dict`` keys) and the values crossing in, and
whose outputs are the values crossing out (the model's outputs for the last stage).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from autopar.core.errors import ConfigError, DoesNotFitError
from autopar.core.meta import StageGraph, evaluate, graph_info, info, set_info

log = logging.getLogger("autopar.pp_split")

_SKIP = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


@dataclass
class OpCosts:
    """Per-op facts along the topological order of a graph's ops (call_function nodes)."""

    ops: list[fx.Node]
    time_s: list[float]               # forward + backward seconds per micro-batch
    saved_bytes: list[float]          # activation bytes forward keeps for backward
    param_bytes: list[float]          # state bytes (params + grads + optimizer) first read here
    crossing_bytes: list[float]       # bytes crossing a cut before op k (index k, 0 unused)
    valid: list[bool]                 # can the graph be cut before op k
    const: set[fx.Node] = field(default_factory=set)  # ops computed from params/constants only


def const_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Ops whose value depends on parameters, buffers and constants only (no user input). An op
    that writes its input in place (BatchNorm's ``num_batches_tracked.add_(1)``) is not one:
    a stage recomputes constants it needs, and this must run once, in one stage."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if info(node).kind in ("param", "buffer", "constant"):
                out.add(node)
        elif node.op in ("call_function", "get_attr"):
            if all(a in out for a in node.all_input_nodes) and not _writes_in_place(node):
                out.add(node)
    return out


def _writes_in_place(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def op_costs(gm: fx.GraphModule, *, node_time: Callable[[fx.Node], float],
             state_bytes_per_param_byte: float = 4.0, sizes: Mapping[str, int] | None = None,
             tp: int = 1, wire: Mapping[str, torch.dtype] | None = None) -> OpCosts:
    """Costs of every op of ``gm`` (static sizes) for :func:`plan_cuts`.

    ``node_time(node)``: forward + backward seconds of one op per micro-batch.
    ``state_bytes_per_param_byte``: bytes of parameter + gradient + optimizer state per byte
    of parameter (4 for fp32 AdamW: the value, its gradient and two moments). ``sizes``: the
    symbolic sizes to price a symbolic graph at (a static graph needs none). ``tp``: the tensor
    axis the graph was rewritten for (a parameter placed ``S(d)`` holds 1/tp of its bytes).
    ``wire``: the dtype a value crosses a cut in, by node name, where it is not the captured one
    (mixed precision: :func:`autopar.passes.autocast.autocast_dtypes`).
    """
    at = dict(sizes or {})
    const = const_nodes(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n not in const]
    index = {n: i for i, n in enumerate(ops)}
    k = len(ops)
    time_s = [node_time(n) for n in ops]
    saved = [float(evaluate(info(n).saved_bytes, at)) for n in ops]
    pbytes = [0.0] * k
    for node in gm.graph.nodes:
        if node.op == "placeholder" and info(node).kind == "param":
            readers = _readers(node, const, index)
            if readers:
                nbytes = float(evaluate(info(node).values[0].nbytes, at)) * state_bytes_per_param_byte
                if tp > 1 and (info(node).placement or "").startswith("S("):
                    nbytes /= tp
                first, last = min(readers), max(readers)
                pbytes[first] += nbytes
                # read again far away (a tied head): a stage holding the last reader holds a copy too
                if info(ops[first]).block_member != info(ops[last]).block_member or \
                        info(ops[first]).block_member is None and last != first:
                    pbytes[last] += nbytes
    # Values crossing a cut before op j: made before j (user inputs at -1), read at or after j.
    delta = [0.0] * (k + 2)
    valid = [True] * (k + 1)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for node in gm.graph.nodes:
        if node in const or node.op == "output":
            continue
        if node.op == "placeholder":
            born = -1
        elif node in index:
            born = index[node]
        else:
            continue
        last = max((index.get(u, k) if u is not out_node else k for u in node.users), default=born)
        if last <= born:
            continue
        nbytes = float(evaluate(info(node).out_bytes, at)) if info(node).values else 0.0
        if wire and node.name in wire and info(node).values and info(node).values[0].dtype.is_floating_point:
            nbytes *= wire[node.name].itemsize / info(node).values[0].dtype.itemsize
        delta[born + 1] += nbytes
        delta[last + 1] -= nbytes
        if _shape_value(node):   # a size read off an input: every stage can read it off its own input
            delta[born + 1] -= nbytes
            delta[last + 1] += nbytes
        elif not _tensor_value(node):
            for j in range(born + 1, last + 1):
                valid[j] = False
    crossing, run = [0.0] * (k + 1), 0.0
    for j in range(k + 1):
        run += delta[j]
        crossing[j] = run
    valid[0] = False
    for j in range(1, k):
        if _name(ops[j]) in _SKIP or _name(ops[j - 1]) in _SKIP:
            valid[j] = False
    return OpCosts(ops=ops, time_s=time_s, saved_bytes=saved, param_bytes=pbytes, crossing_bytes=crossing,
                   valid=valid, const=const)


def _readers(node: fx.Node, const: set[fx.Node], index: dict[fx.Node, int]) -> list[int]:
    """``index`` of every (non-const) op reading ``node``, directly or through const ops (an
    op's position, or its stage)."""
    seen, stack, out = set(), [node], []
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u in seen:
                continue
            seen.add(u)
            if u in index:
                out.append(index[u])
            elif u in const:
                stack.append(u)
    return out


def _shape_value(node: fx.Node) -> bool:
    """A symbolic size (``sym_size`` and arithmetic on sizes) of a symbolic capture."""
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op != "placeholder"


def _tensor_value(node: fx.Node) -> bool:
    """Can this value be sent to the next stage (one tensor)?"""
    vals = info(node).values
    return len(vals) == 1 and not isinstance(node.meta.get("val"), (tuple, list, int, float, torch.SymInt))


@dataclass(frozen=True)
class CutPlan:
    """Stage boundaries and their predicted balance."""

    starts: tuple[int, ...]           # op index each stage starts at (starts[0] == 0)
    stage_time_s: tuple[float, ...]   # forward + backward seconds per micro-batch, per stage
    stage_state_bytes: tuple[float, ...]
    stage_saved_bytes: tuple[float, ...]   # activation bytes per micro-batch, per stage
    crossing_bytes: tuple[float, ...]      # per boundary
    start_nodes: tuple[str, ...]      # name of each stage's first op (what the Plan stores)


def plan_cuts(costs: OpCosts, stages: int, *, p2p_time: Callable[[float], float] = lambda b: 0.0,
              inflight: Sequence[int] | None = None, budget: float | None = None,
              slack: float = 2.0, tolerance: float = 0.03) -> CutPlan:
    """Cut ``costs.ops`` into ``stages`` contiguous stages (see the module docstring).

    ``inflight[s]``: micro-batches whose activations stage ``s`` holds at once under the
    schedule (default 1). ``budget``: bytes per stage (default: unlimited). Cuts whose
    bottleneck is within ``tolerance`` (relative) of the best count as equally balanced; among them
    the smallest total crossing wins (a block boundary sends one tensor, a cut inside a block
    often two, for a balance gain below what the cost model can resolve).
    """
    k = len(costs.ops)
    if stages < 1:
        raise ConfigError("a pipeline needs at least one stage", got=str(stages))
    if stages == 1:
        return _summary(costs, [0])
    inflight = list(inflight) if inflight is not None else [1] * stages
    candidates = _candidates(costs, stages, slack)
    if len(candidates) < stages - 1:
        raise ConfigError(f"the model cannot be cut into {stages} pipeline stages", where="pipeline",
                          expected=f"at least {stages - 1} places to cut", got=f"{len(candidates)}",
                          fix="use fewer pipeline stages (or virtual stages)")
    pos = [0] + candidates + [k]             # DP nodes: 0, candidates..., end
    pre_t = _prefix(costs.time_s)
    pre_p = _prefix(costs.param_bytes)
    pre_a = _prefix(costs.saved_bytes)
    cross = [costs.crossing_bytes[p] if 0 < p < k else 0.0 for p in pos]
    comm = [p2p_time(b) for b in cross]
    n = len(pos)
    inf = float("inf")
    t = torch.tensor
    pos_t = t(pos)
    pre_t_t, pre_p_t, pre_a_t = t(pre_t, dtype=torch.float64), t(pre_p, dtype=torch.float64), t(pre_a, dtype=torch.float64)
    cross_t, comm_t = t(cross, dtype=torch.float64), t(comm, dtype=torch.float64)
    # best[s][j]: (bottleneck seconds, crossing bytes) of the first s+1 stages ending at pos[j]
    best = torch.full((stages, n), inf, dtype=torch.float64)
    tie = torch.full((stages, n), inf, dtype=torch.float64)
    back = torch.zeros((stages, n), dtype=torch.long)

    def stage_cost(s: int, i: torch.Tensor, j: int) -> torch.Tensor:
        lo, hi = pos_t[i], pos[j]
        time = (pre_t_t[hi] - pre_t_t[lo]) + comm_t[i] + comm[j]
        if budget is not None:
            mem = (pre_p_t[hi] - pre_p_t[lo]) + (pre_a_t[hi] - pre_a_t[lo]) * inflight[s]
            time = torch.where(mem > budget, torch.full_like(time, inf), time)
        return time

    for j in range(1, n):
        best[0, j] = stage_cost(0, t([0]), j)[0]
        tie[0, j] = cross[j] if j < n - 1 else 0.0
    for s in range(1, stages):
        for j in range(s + 1, n):
            if s == stages - 1 and j != n - 1:
                continue
            i = torch.arange(s, j)
            cand = torch.maximum(best[s - 1, s:j], stage_cost(s, i, j))
            tb = tie[s - 1, s:j] + (cross_t[j] if j < n - 1 else 0.0)
            lo = cand.min()
            if not torch.isfinite(lo):
                continue
            close = cand <= lo * (1 + tolerance) + 1e-15
            pick = torch.where(close, tb, torch.full_like(tb, inf)).argmin()
            best[s, j], tie[s, j], back[s, j] = cand[pick], tb[pick], i[pick]
    if not torch.isfinite(best[stages - 1, n - 1]):
        raise DoesNotFitError(f"no way to cut the model into {stages} stages fits the memory budget",
                              where="pipeline", expected=f"each stage within {budget / 2**30:.2f} GiB" if budget
                              else "a fit", fix="use more pipeline stages, fewer micro-batches in flight, or recompute")
    ends, j = [], n - 1
    for s in range(stages - 1, 0, -1):
        j = int(back[s, j])
        ends.append(pos[j])
    return _summary(costs, [0] + sorted(ends), comm_of=p2p_time)


def _candidates(costs: OpCosts, stages: int, slack: float) -> list[int]:
    k = len(costs.ops)
    ok = [j for j in range(1, k) if costs.valid[j]]
    if not ok:
        return []
    least = min(costs.crossing_bytes[j] for j in ok)
    limit = max(least, 1.0) * slack
    while True:
        got = [j for j in ok if costs.crossing_bytes[j] <= limit]
        if len(got) >= 4 * (stages - 1) or len(got) == len(ok):
            return got
        limit *= 2


def _prefix(values: Sequence[float]) -> list[float]:
    out, run = [0.0], 0.0
    for v in values:
        run += v
        out.append(run)
    return out


def _summary(costs: OpCosts, starts: list[int], comm_of: Callable[[float], float] = lambda b: 0.0) -> CutPlan:
    k = len(costs.ops)
    ends = starts[1:] + [k]
    times, state, saved = [], [], []
    for s, (a, b) in enumerate(zip(starts, ends)):
        t = sum(costs.time_s[a:b])
        t += (comm_of(costs.crossing_bytes[a]) if a > 0 else 0.0) + (comm_of(costs.crossing_bytes[b]) if b < k else 0.0)
        times.append(t)
        state.append(sum(costs.param_bytes[a:b]))
        saved.append(sum(costs.saved_bytes[a:b]))
    return CutPlan(starts=tuple(starts), stage_time_s=tuple(times), stage_state_bytes=tuple(state),
                   stage_saved_bytes=tuple(saved), crossing_bytes=tuple(costs.crossing_bytes[a] for a in starts[1:]),
                   start_nodes=tuple(costs.ops[a].name for a in starts))


def layer_cuts(costs: OpCosts, stages: int) -> CutPlan:
    """The naive cut: the repeated blocks dealt out equally (the first and last stage also get
    whatever comes before the first block and after the last), for comparison."""
    gm_blocks: list[int] = []
    seen = set()
    for j, node in enumerate(costs.ops):
        member = info(node).block_member
        if member is not None and member not in seen:
            seen.add(member)
            gm_blocks.append(j)
    if len(gm_blocks) < stages:
        raise ConfigError(f"the model has {len(gm_blocks)} blocks, fewer than {stages} stages", where="pipeline")
    per, extra = divmod(len(gm_blocks), stages)
    starts, b = [0], 0
    for s in range(stages - 1):
        b += per + (1 if s < extra else 0)
        starts.append(gm_blocks[b])
    return _summary(costs, starts)


# ------------------------------------------------------------------------------ split

def split_stages(gm: fx.GraphModule, starts: Sequence[int] | Sequence[str]) -> list[StageGraph]:
    """Per-stage graphs for cuts before the ops ``starts`` (op indices or node names; the first
    is op 0). The model's outputs come out of the last stage."""
    const = const_nodes(gm)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n not in const]
    by_name = {n.name: i for i, n in enumerate(ops)}
    idx = []
    for s in starts:
        if isinstance(s, str):
            if s not in by_name:
                raise ConfigError(f"the plan cuts the pipeline before node {s!r}, which this graph does not have",
                                  where="plan.stages", fix="re-plan the pipeline for this model")
            idx.append(by_name[s])
        else:
            idx.append(int(s))
    if idx[0] != 0 or idx != sorted(set(idx)):
        raise ConfigError("stage starts must begin at the first op and increase", where="plan.stages", got=str(idx))
    stage_of = {}
    bounds = idx + [len(ops)]
    for s in range(len(idx)):
        for j in range(bounds[s], bounds[s + 1]):
            stage_of[ops[j]] = s
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    last = len(idx) - 1
    users_stage: dict[fx.Node, int] = {}          # latest stage reading each value
    for node in gm.graph.nodes:
        if node in const or node.op == "output":
            continue
        stages_reading = [stage_of[u] if u is not out_node else last for u in node.users if u in stage_of or u is out_node]
        for u in node.users:
            if u in const:
                stages_reading += _readers(u, const, stage_of)
        if stages_reading:
            users_stage[node] = max(stages_reading)
    ginfo = graph_info(gm)
    result = []
    for s in range(len(idx)):
        mine = [n for n in ops if stage_of[n] == s]
        needed_const = _const_closure(mine + ([out_node] if s == last else []), const)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        params, buffers, order = [], [], []
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node in needed_const:
                rec = info(node)
                new = g.placeholder(node.name)
                new.meta = dict(node.meta)
                env[node] = new
                (params if rec.kind == "param" else buffers).append(rec.target_fqn)
                order.append((rec.kind, rec.target_fqn))
        # values crossing in: made before this stage (or user inputs), read here or later
        inputs = []
        for node in gm.graph.nodes:
            if node in const or node.op == "output":
                continue
            born = -1 if node.op == "placeholder" else stage_of.get(node)
            if born is None or born >= s:
                continue
            if users_stage.get(node, -1) >= s:
                new = g.placeholder(node.name)
                new.meta = dict(node.meta)
                env[node] = new
                inputs.append(node.name)
                order.append(("act", node.name))
        for node in gm.graph.nodes:
            if node.op == "get_attr" and any(stage_of.get(u) == s or u in needed_const for u in node.users):
                env[node] = g.node_copy(node)       # a higher-order op's body (a no_grad block): the stage keeps it
            elif node.op == "call_function" and (node in needed_const and node.op != "placeholder"
                                                 or stage_of.get(node) == s):
                env[node] = g.node_copy(node, lambda a: env[a])
        if s == last:
            outs = [a for a in out_node.args[0]] if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
            g.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in outs))
            outputs = [a.name if isinstance(a, fx.Node) else repr(a) for a in outs]
        else:
            crossing = [n for n in gm.graph.nodes if n in env and n not in const and n.op != "output"
                        and users_stage.get(n, -1) > s]
            g.output(tuple(_handoff(g, env[n], n, stage_of, s) for n in crossing))
            outputs = [n.name for n in crossing]
        g.lint()
        sgm = fx.GraphModule(gm, g)
        sgm.meta.update(gm.meta)
        result.append(StageGraph(index=s, gm=sgm, params=params, buffers=buffers, inputs=inputs,
                                 outputs=outputs, order=order))
    del ginfo
    return result


def _handoff(g: fx.Graph, value: fx.Node, orig: fx.Node, stage_of: dict[fx.Node, int], s: int) -> fx.Node:
    """What stage ``s`` sends of ``orig``: the value itself, or a copy when the stage also
    reads it (or only passes it on). The pipeline runtime detaches a stage's outputs in place
    once their gradient has gone back (zero-bubble schedules), which must not touch a value the
    stage's own weight gradients still need."""
    if orig.op != "placeholder" and not any(stage_of.get(u) == s for u in orig.users):
        return value
    out = g.call_function(torch.ops.aten.clone.default, (value,))
    out.meta = dict(value.meta)
    set_info(out, dataclasses.replace(info(orig), made_by="pp_split", saved_bytes=info(orig).saved_bytes * 0))
    return out


def _const_closure(nodes: list[fx.Node], const: set[fx.Node]) -> set[fx.Node]:
    """The const nodes (and param/buffer placeholders) ``nodes`` read, transitively."""
    out: set[fx.Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes if a in const]
    while stack:
        cur = stack.pop()
        if cur in out:
            continue
        out.add(cur)
        stack.extend(a for a in cur.all_input_nodes if a in const)
    return out


def shared_params(stages: Sequence[StageGraph]) -> dict[str, list[int]]:
    """Parameters held by more than one stage: fqn -> stage indices (their gradients are summed)."""
    where: dict[str, list[int]] = {}
    for st in stages:
        for fqn in st.params:
            where.setdefault(fqn, []).append(st.index)
    return {f: s for f, s in where.items() if len(s) > 1}


__all__ = ["OpCosts", "CutPlan", "StageGraph", "const_nodes", "op_costs", "plan_cuts", "layer_cuts",
           "split_stages", "shared_params"]
