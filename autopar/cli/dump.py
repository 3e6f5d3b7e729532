"""Render an analysed graph for people: text (terminal), JSON (tools), DOT (Graphviz).

Every figure is evaluated at the sizes asked for (``batch``, ``seq``); JSON also carries
the formulas, so a tool can evaluate them elsewhere. A planned or rewritten graph
(``autopar dump --mesh tp=N --after plan|rewrite``) also shows each node's placement and
strategy, the collectives the rewrite inserted, and a summary of their predicted cost.
"""
from __future__ import annotations

import json
from typing import Any


import torch.fx as fx

from autopar.core.meta import NodeInfo, graph_info, info
from autopar.summary import Totals, at, module_rows, peak_live, state_memory, totals


def human(x: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (bytes in binary units when unit == 'B')."""
    base, names = (1024.0, ["", "Ki", "Mi", "Gi", "Ti", "Pi"]) if unit == "B" else (1000.0, ["", "K", "M", "G", "T", "P", "E"])
    x = float(x)
    for name in names:
        if abs(x) < base or name == names[-1]:
            return f"{x:.0f}{name}{unit}" if name == "" else f"{x:.2f}{name}{unit}"
        x /= base
    return str(x)


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        t = node.target
        name = getattr(t, "__name__", str(t))
        return name if not hasattr(t, "_overloadpacket") else str(t).replace("aten.", "").replace(".default", "")
    return node.op


def _shape_str(rec: NodeInfo) -> str:
    if not rec.values:
        return "-"
    return " ".join("[" + ",".join(str(s) for s in v.shape) + "]" + _dt(v.dtype) for v in rec.values[:2]) + \
        (" …" if len(rec.values) > 2 else "")


def _dt(dtype: Any) -> str:
    return ":" + str(dtype).replace("torch.", "").replace("float", "f").replace("int", "i")


def node_rows(gm: fx.GraphModule, sizes: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for n in gm.graph.nodes:
        rec = info(n)
        rows.append({
            "name": n.name, "op": _op_name(n), "kind": rec.kind, "fqn": rec.fqn,
            "module_type": rec.module_type, "param": rec.target_fqn,
            "shapes": [[str(s) for s in v.shape] for v in rec.values],
            "shapes_at_size": [[at(s, sizes) for s in v.shape] for v in rec.values],
            "dtypes": [str(v.dtype).replace("torch.", "") for v in rec.values],
            "requires_grad": rec.requires_grad,
            "flops_fwd": at(rec.flops_fwd, sizes), "flops_bwd": at(rec.flops_bwd, sizes),
            "bytes_fwd": at(rec.bytes_fwd, sizes), "bytes_bwd": at(rec.bytes_bwd, sizes),
            "saved_bytes": at(rec.saved_bytes, sizes), "live_bytes": at(rec.live_bytes, sizes),
            "block_class": rec.block_class, "block_member": rec.block_member,
            "moe_role": rec.moe_role, "moe_region": rec.moe_region,
        })
        _add_parallel_fields(rows[-1], rec)
    return rows


def _add_parallel_fields(row: dict[str, Any], rec: NodeInfo) -> None:
    """Placement, strategy and inserted collective of a planned/rewritten node, only when set."""
    if rec.stage is not None:
        row["stage"] = rec.stage
    if rec.placement is not None:
        row["placement"] = rec.placement
    if rec.strategy is not None:
        row["strategy"] = rec.strategy
    c = rec.collective
    if c is not None:
        row["collective"] = {"axis": c.axis, "forward": c.forward, "backward": c.backward, "src": c.src,
                             "dst": c.dst, "bytes": c.nbytes, "time_fwd_s": c.time_fwd_s,
                             "time_bwd_s": c.time_bwd_s}
        if c.bucket:
            row["collective"].update(bucket=c.bucket, params=list(c.params))


def collective_summary(gm: fx.GraphModule) -> dict[str, Any]:
    """Inserted collectives counted by forward and by backward step kind, with total predicted seconds."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    axes: set[str] = set()
    count, t_fwd, t_bwd, nbytes = 0, 0.0, 0.0, 0.0
    for n in gm.graph.nodes:
        c = info(n).collective
        if c is None:
            continue
        count += 1
        axes.add(c.axis)
        fwd[c.forward] = fwd.get(c.forward, 0) + 1
        bwd[c.backward] = bwd.get(c.backward, 0) + 1
        t_fwd += c.time_fwd_s
        t_bwd += c.time_bwd_s
        nbytes += c.nbytes
    return {"count": count, "axes": sorted(axes),
            "forward": dict(sorted(fwd.items(), key=lambda kv: (-kv[1], kv[0]))),
            "backward": dict(sorted(bwd.items(), key=lambda kv: (-kv[1], kv[0]))),
            "bytes": nbytes, "time_fwd_s": t_fwd, "time_bwd_s": t_bwd}


def to_json(gm: fx.GraphModule, sizes: dict[str, int], *, model: str = "", optimizer: str = "adamw",
            nodes: bool = True, parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    """``parallel`` (``{"mesh": {...}, "after": "plan"|"rewrite", "predicted": {...}}``) is set for a
    planned graph: it is copied to the output, and after the rewrite a ``collectives`` summary is added."""
    t = totals(gm)
    ginfo = graph_info(gm)
    out: dict[str, Any] = {
        "model": model, "sizes": sizes, "symbols": sorted(ginfo.symbols),
        "totals": _totals_json(t, sizes, gm, optimizer),
        "formulas": {k: str(getattr(t, k)) for k in ("flops_fwd", "flops_bwd", "bytes_fwd", "activation_bytes")},
        "modules": [{"fqn": r.fqn, "module_type": r.module_type, "params": r.params, "nodes": r.nodes,
                     "flops_fwd": at(r.flops_fwd, sizes), "flops_bwd": at(r.flops_bwd, sizes),
                     "activation_bytes": at(r.activation_bytes, sizes), "block_class": r.block_class}
                    for r in module_rows(gm)],
        "block_classes": [{"id": c.id, "module_type": c.module_type, "members": list(c.members),
                           "nodes_per_member": c.nodes_per_member} for c in ginfo.block_classes],
        "moe_regions": [{"fqn": r.fqn, "num_experts": r.num_experts, "top_k": r.top_k,
                         "capacity": None if r.capacity is None else at(r.capacity, sizes),
                         "capacity_formula": None if r.capacity is None else str(r.capacity),
                         "router_weight": r.router_weight, "expert_params": list(r.expert_params)}
                        for r in ginfo.moe_regions],
        "passes": list(ginfo.passes_run),
        "capture": {"use_cache": False if ginfo.without_cache else None, "tied": dict(ginfo.param_aliases),
                    "constants": sorted(ginfo.constants)},
    }
    if parallel is not None:
        out["parallel"] = dict(parallel)
        if parallel.get("after") in ("rewrite", "schedule"):
            out["collectives"] = collective_summary(gm)
        if parallel.get("after") == "schedule":
            from autopar.passes.dp_rewrite import schedule_table
            out["schedule"] = schedule_table(gm)
    if nodes:
        out["nodes"] = node_rows(gm, sizes)
    return out


def _totals_json(t: Totals, sizes: dict[str, int], gm: fx.GraphModule, optimizer: str) -> dict[str, Any]:
    return {
        "params": t.params, "trainable_params": t.trainable_params, "active_params": t.active_params,
        "buffers": t.buffers,
        "flops_fwd": at(t.flops_fwd, sizes), "flops_bwd": at(t.flops_bwd, sizes),
        "bytes_fwd": at(t.bytes_fwd, sizes), "bytes_bwd": at(t.bytes_bwd, sizes),
        "activation_bytes": at(t.activation_bytes, sizes), "peak_live_bytes": peak_live(t, sizes),
        "state_bytes": state_memory(gm, optimizer), "optimizer": optimizer,
    }


def to_text(gm: fx.GraphModule, sizes: dict[str, int], *, model: str = "", optimizer: str = "adamw",
            nodes: bool = True, parallel: dict[str, Any] | None = None) -> str:
    data = to_json(gm, sizes, model=model, optimizer=optimizer, nodes=nodes, parallel=parallel)
    lines = [f"autopar dump: {model}  at {', '.join(f'{k}={v}' for k, v in sizes.items()) or 'static sizes'}"
             + (f"  on {_mesh_str(parallel['mesh'])}, after {parallel['after']} "
                f"(shapes and figures are whole tensors; placement says how each is split)" if parallel else "")]
    if nodes:
        placed = any("placement" in r or "strategy" in r for r in data["nodes"])
        staged = any("stage" in r for r in data["nodes"])
        lines.append((f"{'stage':>5} " if staged else "") + f"{'node':<24} {'op':<28} {'module':<22} {'shape':<28} {'fwd FLOP':>9} {'bwd FLOP':>9} "
                     f"{'bytes':>9} {'saved':>9}" + (f" {'placement':<10} strategy / collective" if placed else ""))
        for r in data["nodes"]:
            if r["kind"] == "output":
                continue
            shape = " ".join("[" + ",".join(str(s) for s in sh) + "]" for sh in r["shapes_at_size"][:2])
            tag = f" #{r['moe_role']}" if r["moe_role"] else ""
            lines.append((f"{r['stage'] if 'stage' in r else '*':>5} " if staged else "") +
                         f"{r['name'][:24]:<24} {r['op'][:28]:<28} {(r['fqn'] or '.')[:22]:<22} {shape[:28]:<28} "
                         f"{human(r['flops_fwd']):>9} {human(r['flops_bwd']):>9} {human(r['bytes_fwd'], 'B'):>9} "
                         f"{human(r['saved_bytes'], 'B'):>9}" + (_parallel_cells(r) if placed else "") + tag)
    lines += ["", _module_table(data), "", _totals_text(data)]
    if parallel:
        lines.append(_parallel_text(data))
    return "\n".join(lines)


def _mesh_str(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def seconds(x: float) -> str:
    """0.000139 -> '139.0us'."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}" if unit != "s" else f"{x:.3g}s"
    return "0" if x == 0 else f"{x * 1e9:.0f}ns"


def _parallel_cells(r: dict[str, Any]) -> str:
    c = r.get("collective")
    if c is not None and c.get("bucket"):
        what = (f"{c['axis']} {c['bucket']}: fwd {c['forward']} / bwd {c['backward']}  {len(c['params'])} params "
                f"{human(c['bytes'], 'B')}")
    elif c is not None:
        what = (f"{c['axis']}: {c['forward']} / {c['backward']}  {c['src']} -> {c['dst']}  {human(c['bytes'], 'B')}"
                f"  fwd {seconds(c['time_fwd_s'])} bwd {seconds(c['time_bwd_s'])}")
    else:
        what = r.get("strategy") or ""
    return f" {(r.get('placement') or '-')[:10]:<10} {what}".rstrip()


def _parallel_text(data: dict[str, Any]) -> str:
    p = data["parallel"]
    pred = p.get("predicted") or {}
    lines = [f"plan            {_mesh_str(p['mesh'])}: predicted step {seconds(pred.get('step_time_s', 0.0))} "
             f"(compute {seconds(pred.get('compute_s', 0.0))}, comm {seconds(pred.get('comm_s', 0.0))}), "
             f"state {human(pred.get('state_bytes_per_rank', 0.0), 'B')} per rank"]
    if p.get("hardware"):
        lines.append(f"hardware        priced for {p['hardware']}")
    c = data.get("collectives")
    if c is not None:
        def kinds(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"
        lines += [f"collectives     {c['count']} inserted on {', '.join(c['axes']) or '-'}; "
                  f"forward: {kinds(c['forward'])}; backward: {kinds(c['backward'])}",
                  f"comm time       forward {seconds(c['time_fwd_s'])}, backward {seconds(c['time_bwd_s'])} "
                  f"(predicted, sum over inserted collectives)"]
    if p.get("zero_stage") is not None and "dp" in p["mesh"]:
        mem = pred.get("memory_bytes") or {}
        lines.append(f"data axis       dp={p['mesh']['dp']}, ZeRO-{p['zero_stage']}, overlap "
                     f"{'on' if p.get('overlap', True) else 'off'}; memory per device: "
                     + ", ".join(f"{k} {human(v, 'B')}" for k, v in mem.items()))
    pipe = p.get("pipeline")
    if pipe:
        lines.append(f"pipeline        pp={pipe['pp']}, {pipe['schedule']} schedule, {pipe['microbatches']} micro-batches, "
                     f"{pipe['virtual_stages']} stage(s) per device; predicted step {seconds(pipe['step_time_s'])}, "
                     f"bubble {pipe['bubble_fraction']:.3f} (ops marked * are recomputed on each stage that reads them)")
        for row in p.get("stages") or []:
            lines.append(f"stage {row['stage']:<3} device {row['device']:<3} from {row['first'][:24]:<24} "
                         f"{row['ops']:>5} ops  {seconds(row['time_s']):>8} per micro-batch  state "
                         f"{human(row['state_bytes'], 'B'):>8}  activations {human(row['activation_bytes'], 'B'):>8}"
                         f"  sends {human(row['sends_bytes'], 'B'):>8}")
    for row in data.get("schedule") or []:
        fwd = ", ".join(f"{k.replace('_', ' ')} {row[k]}" for k in ("forward_issue", "forward_wait",
                                                                    "forward_position") if k in row)
        bwd = ", ".join(f"{k.replace('_', ' ')} {row[k]}" for k in ("backward_issue", "backward_wait") if k in row)
        lines.append(f"schedule {row['bucket']:<6} {row.get('kind', ''):<26} {row['params']:>3} params "
                     f"{human(row['bytes'], 'B'):>8}  {fwd}; {bwd}")
    return "\n".join(lines)


def _module_table(data: dict[str, Any]) -> str:
    lines = [f"{'module':<28} {'type':<18} {'params':>9} {'fwd FLOP':>9} {'bwd FLOP':>9} {'activations':>11}"]
    seen: set[int] = set()
    for m in data["modules"]:
        cls = m["block_class"]
        count = 1
        name = m["fqn"] or "(root)"
        if cls is not None:
            if cls in seen:
                continue
            seen.add(cls)
            members = next(c["members"] for c in data["block_classes"] if c["id"] == cls)
            count = sum(1 for x in data["modules"] if x["block_class"] == cls)
            name = f"{members[0]} ×{count}"
        lines.append(f"{name[:28]:<28} {m['module_type'][:18]:<18} {human(m['params'] * count):>9} "
                     f"{human(m['flops_fwd'] * count):>9} {human(m['flops_bwd'] * count):>9} "
                     f"{human(m['activation_bytes'] * count, 'B'):>11}")
    return "\n".join(lines)


def _totals_text(data: dict[str, Any]) -> str:
    t = data["totals"]
    s = t["state_bytes"]
    lines = [
        f"parameters      {human(t['params'])} ({t['params']:,}); trainable {human(t['trainable_params'])}; "
        f"active per token {human(t['active_params'])}",
        f"FLOPs           forward {human(t['flops_fwd'])}, backward {human(t['flops_bwd'])}, "
        f"step {human(t['flops_fwd'] + t['flops_bwd'])}",
        f"bytes moved     forward {human(t['bytes_fwd'], 'B')}, backward {human(t['bytes_bwd'], 'B')}",
        f"memory          params {human(s['params'], 'B')}, grads {human(s['grads'], 'B')}, "
        f"optimizer ({t['optimizer']}) {human(s['optimizer'], 'B')}, buffers {human(s['buffers'], 'B')}",
        f"activations     kept for backward {human(t['activation_bytes'], 'B')}, "
        f"forward peak live {human(t['peak_live_bytes'], 'B')}",
    ]
    for c in data["block_classes"]:
        lines.append(f"block class {c['id']}   {len(c['members'])} × {c['module_type'] or 'module'} "
                     f"({c['members'][0]} … {c['members'][-1]}), {c['nodes_per_member']} nodes each")
    for r in data["moe_regions"][:1]:
        lines.append(f"MoE regions     {len(data['moe_regions'])} (first {r['fqn']}): {r['num_experts']} experts, "
                     f"top-{r['top_k']}, capacity {r['capacity']}")
    if data["symbols"]:
        lines.append(f"formulas        forward FLOPs = {data['formulas']['flops_fwd']}")
    cap = data["capture"]
    if cap["use_cache"] is False:
        lines.append("captured with    use_cache=False (a training graph holds no inference cache)")
    for alias, name in sorted(cap["tied"].items()):
        lines.append(f"tied            {alias} is {name} (one parameter)")
    return "\n".join(lines)


def to_dot(gm: fx.GraphModule, sizes: dict[str, int], *, model: str = "", fold: bool = True) -> str:
    """Graphviz DOT: one cluster per top-level module (depth 2), edges along data flow.

    ``fold`` (the default; ``autopar dump --unfold`` turns it off): every repeated block class
    (the analysis's ``block_classes``, e.g. 32 transformer layers) is one node labelled like the
    per-module table, ``layers.0 ×32``, with its ops' count and FLOPs; the edges into and out
    of the blocks are kept (drawn to and from that node), those inside them and between
    consecutive copies are not."""
    ginfo = graph_info(gm)
    folded = {c.id: c for c in ginfo.block_classes if fold and len(c.members) > 1}

    member_of = {m: cls for cls, c in folded.items() for m in c.members}

    def ref(n: fx.Node) -> str:
        rec = info(n)
        cls = rec.block_class if rec.block_member is not None else None
        parts = rec.fqn.split(".") if rec.fqn else []
        while cls not in folded and parts:   # an op the block classes leave out (an assert), inside a copy
            cls = member_of.get(".".join(parts))
            parts.pop()
        return f"block class {cls}" if cls in folded else n.name

    clusters: dict[str, list[str]] = {}
    lines = [f'digraph "{model or "autopar"}" {{', "  rankdir=TB; node [shape=box, fontsize=9];"]
    block_flops: dict[int, Any] = {}
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind in ("param", "buffer", "constant"):
            continue
        name = ref(n)
        if name != n.name:            # one op of a folded block: counted into the block's node
            cls = int(name.rsplit(" ", 1)[1])
            block_flops[cls] = block_flops.get(cls, 0) + rec.flops_fwd
            continue
        shape = ",".join(str(at(s, sizes)) for s in rec.values[0].shape) if rec.values else ""
        flops = f"\\n{human(at(rec.flops_fwd, sizes))}FLOP" if rec.flops_fwd != 0 else ""
        color = ', style=filled, fillcolor="#ffe0b0"' if rec.moe_role else ""
        if rec.collective is not None:
            c = rec.collective
            flops = f"\\n{c.axis}: {c.forward} / {c.backward}\\n{c.src} -> {c.dst}"
            color = ', style=filled, fillcolor="#c0e0ff"'
        decl = f'    "{n.name}" [label="{_op_name(n)}\\n[{shape}]{flops}"{color}];'
        key = ".".join(rec.fqn.split(".")[:2]) if rec.fqn else ""
        clusters.setdefault(key, []).append(decl)
    for i, (key, decls) in enumerate(clusters.items()):
        if key:
            lines.append(f'  subgraph cluster_{i} {{ label="{key}";')
            lines += decls
            lines.append("  }")
        else:
            lines += [d[2:] for d in decls]
    for cls in block_flops:          # each folded block class: one node, in graph order
        c = folded[cls]
        flops = human(at(block_flops[cls], sizes))   # summed over every copy
        label = (f"{c.members[0]} ×{len(c.members)}\\n{c.module_type or 'block'}, {c.nodes_per_member} ops each"
                 f"\\n{flops}FLOP forward in all")
        lines.append(f'  "block class {cls}" [label="{label}", shape=box3d, style=filled, fillcolor="#e8e8ff"];')
    seen: set[tuple[str, str]] = set()
    for n in gm.graph.nodes:
        if info(n).kind in ("param", "buffer", "constant"):
            continue
        for a in n.all_input_nodes:
            if info(a).kind not in ("param", "buffer", "constant"):
                edge = (ref(a), ref(n))
                if edge[0] != edge[1] and edge not in seen:
                    seen.add(edge)
                    lines.append(f'  "{edge[0]}" -> "{edge[1]}";')
    lines.append("}")
    return "\n".join(lines)


def render(gm: fx.GraphModule, sizes: dict[str, int], fmt: str, *, model: str = "", nodes: bool = True,
           parallel: dict[str, Any] | None = None, fold: bool = True) -> str:
    if fmt == "json":
        return json.dumps(to_json(gm, sizes, model=model, nodes=nodes, parallel=parallel), indent=1)
    if fmt == "dot":
        return to_dot(gm, sizes, model=model, fold=fold)
    return to_text(gm, sizes, model=model, nodes=nodes, parallel=parallel)


