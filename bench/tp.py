"""Benchmark: autopar tensor-parallel training step vs torch's DTensor tensor parallel, two layouts.

Command:  python bench/tp.py [--worlds 2,4] [--steps 20] [--layers 2 --hidden 256 --heads 8
                              --vocab 512 --batch 4 --seq 128] [--variants ...]
Same GPT model, same weights, same inputs and targets, gloo on this machine's CPU. For each
world size, in the same processes, it times a full training step (forward, cross-entropy,
backward, AdamW step, zero_grad) of five variants, rotating their order step by step:
  torch-basic:  ``parallelize_module`` with Megatron's plan without sequence parallelism:
                ColwiseParallel for attn q/k/v and mlp fc, RowwiseParallel for attn o_proj and
                mlp proj; embeddings, norms and the tied head replicated plain tensors;
  torch-sp:     the sequence-parallel plan (torchtitan's layout for this model): the token and
                position embeddings RowwiseParallel (vocabulary / position rows split, output
                split along the sequence), norms SequenceParallel, attention and MLP inputs
                gathered by PrepareModuleInput, o_proj / proj RowwiseParallel back to a sequence
                split, the tied head column-parallel over the vocabulary (input gathered,
                logits gathered);
  autopar-free: ``autopar.parallelize`` with the plan the cost model finds (``autopar.plan``);
  autopar-basic / autopar-sp: autopar forced to each torch layout: the same parameter
                placements (``placements=``) and ``sequence_parallel=False`` / ``True``.
Ratios of median step time (a step's time is the slowest rank's): each autopar variant
against the torch plan of its layout, and autopar-free against both (goal <= 1.05); per-rank
parameter bytes of each forced layout against its torch plan (goal 1.00). Every variant's
loss is compared with the unsplit model's at step 0 and with torch-basic's at every step.

torch's TP needs the attention to reshape with the *local* head count. GPTAttention views
with ``self.heads`` (set to heads // world on every attention module, as torchtitan does)
but reshapes its output with the input's full width ``h``; the torch copies therefore run a
bench-local attention forward with identical maths that reshapes to ``(b, s, -1)``, and the
sequence-parallel copy a bench-local top-level forward that gathers the final norm's output
and the logits (what ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()) does
for an ``nn.Linear`` head; the GPT's head is ``F.linear`` on the tied ``wte.weight``).
The autopar copies run the model unmodified.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

# torch warns at import when NumPy is absent; the bench never needs NumPy.
import warnings
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import _common as common  # noqa: E402 - bench/ is the script directory


def _config(a: argparse.Namespace) -> dict:
    return {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "vocab": a.vocab, "max_seq": a.seq}


def _build(cfg: dict, device: str = "cpu"):
    from autopar import models
    torch.manual_seed(0)
    return models.build("gpt2-small", cfg, device=device)


def _data(model, batch: int, seq: int, vocab: int, device: str = "cpu"):
    from autopar import models
    torch.manual_seed(1)
    args, _ = models.example_inputs(model, batch, seq, device=device)
    torch.manual_seed(2)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    return args, targets


VARIANTS = ("torch-basic", "torch-sp", "autopar-free", "autopar-basic", "autopar-sp")
# each autopar variant against the torch plan(s) it is measured against
PEERS = {"autopar-free": ("torch-basic", "torch-sp"), "autopar-basic": ("torch-basic",), "autopar-sp": ("torch-sp",)}


def _tp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _local_heads(model, world: int) -> None:
    for block in model.layers:
        block.attn.heads = model.config.heads // world
        block.attn.forward = types.MethodType(common.local_attn_forward, block.attn)


def _torch_basic(model, world: int):
    """Megatron's layout without sequence parallelism (see the module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _tp_mesh(world)
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
        })
    _local_heads(model, world)
    return model


def _sp_forward(self, idx: torch.Tensor) -> torch.Tensor:
    """GPT.forward for torch's sequence-parallel layout: the blocks carry each rank's sequence
    slice; the final norm's output is gathered, the tied head runs on this rank's vocabulary
    rows and the logits are gathered."""
    from torch.distributed.tensor import Replicate
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = self.wte(idx) + self.wpe(pos)
    for layer in self.layers:
        x = layer(x)
    h = self.ln_f(x).redistribute(placements=[Replicate()])
    return F.linear(h, self.wte.weight).redistribute(placements=[Replicate()]).to_local()


def _torch_sp(model, world: int):
    """Megatron's layout with sequence parallelism, as torchtitan writes it (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = _tp_mesh(world)
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    _local_heads(model, world)
    model.forward = types.MethodType(_sp_forward, model)
    return model


def _layout_placements(cfg: dict, sequence: bool) -> dict[str, str]:
    """The torch plan's parameter placements, as autopar's ``placements=`` (module docstring):
    column-parallel weights and biases split on dim 0, row-parallel weights on dim 1; the
    embeddings split by rows under the sequence-parallel layout, whole otherwise."""
    out = {"wte.weight": "S(0)" if sequence else "R", "wpe.weight": "S(0)" if sequence else "R"}
    for i in range(cfg["layers"]):
        pre = f"layers.{i}."
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc"):
            out[pre + name + ".weight"] = out[pre + name + ".bias"] = "S(0)"
        for name in ("attn.o_proj", "mlp.proj"):
            out[pre + name + ".weight"], out[pre + name + ".bias"] = "S(1)", "R"
        for name in ("ln1", "ln2"):
            out[pre + name + ".weight"] = out[pre + name + ".bias"] = "R"
    out["ln_f.weight"] = out["ln_f.bias"] = "R"
    return out


def _param_bytes(module) -> dict[str, int]:
    """Bytes of this rank's local tensor of every parameter, by name."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in module.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out[name] = t.numel() * t.element_size()
    return out


def _step(model, opt, args, targets) -> tuple[float, float]:
    """One training step; (seconds, loss). Ranks are aligned by a barrier before the clock starts."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    logits = model(*args)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, float(loss.detach())


def rank_work(rank: int, world: int, cfg: dict, batch: int, seq: int, plans: dict, names: list[str],
              warmup: int, steps: int) -> dict:
    import autopar
    import torch.distributed as dist

    torch.set_num_threads(1)
    ref_model = _build(cfg)
    args, targets = _data(ref_model, batch, seq, cfg["vocab"])
    with torch.no_grad():
        ref_logits = ref_model(*args)
        ref_loss = float(F.cross_entropy(ref_logits.reshape(-1, cfg["vocab"]), targets.reshape(-1)))
    del ref_model, ref_logits

    built = {}
    for name in names:
        if name.startswith("autopar"):
            built[name] = autopar.parallelize(_build(cfg), world, args, plan=plans[name])
        else:
            built[name] = (_torch_basic if name == "torch-basic" else _torch_sp)(_build(cfg), world)
    variants = {k: (m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for k, m in built.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + steps):
        k = i % len(names)
        order = names[k:] + names[:k]           # rotate: no variant always goes first
        for name in (order if i % 2 == 0 else order[::-1]):
            model, opt = variants[name]
            dt, loss = _step(model, opt, args, targets)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt)
    dist.barrier()
    return {"times": times, "losses": losses, "ref_loss": ref_loss,
            "param_bytes": {k: _param_bytes(m) for k, m in built.items()}}


def _plans(cfg: dict, world: int, batch: int, seq: int, names: list[str]) -> dict:
    import autopar
    model = _build(cfg, device="meta")
    args, _ = _data(model, batch, seq, cfg["vocab"], device="meta")
    sizes = {"batch": batch, "seq": seq}
    out = {}
    for name in names:
        if name == "autopar-free":
            out[name] = autopar.plan(model, world, args, sizes=sizes)
        elif name in ("autopar-basic", "autopar-sp"):
            sp = name == "autopar-sp"
            out[name] = autopar.plan(model, world, args, sizes=sizes, placements=_layout_placements(cfg, sp),
                                     sequence_parallel=sp)
    return out


def _fmt_plan(plan) -> str:
    by: dict[str, list[str]] = {}
    for key, p in plan.params.items():
        parts = key.split(".")
        short = ".".join(parts[2:]) if parts[0] == "layers" else key  # layers.<i>.attn.q_proj.weight -> attn.q_proj.weight
        if short not in by.get(p, []):
            by.setdefault(p, []).append(short)
    s = plan.summary()
    seq = sum(1 for k, st in plan.nodes.items() if k.startswith("layer_norm") and "S(1)" in str(st.outputs))
    lines = [f"  sharded {s['sharded_params']} / {len(plan.params)} params; norms on a sequence split: {seq}; "
             f"predicted step {s['step_time_s'] * 1e3:.1f} ms (compute {s['compute_s'] * 1e3:.1f}, "
             f"comm {s['comm_s'] * 1e3:.1f})"]
    for p in sorted(by):
        lines.append(f"  {p:>5}: {', '.join(by[p])}")
    return "\n".join(lines)


def main() -> int:
    from autopar.runtime.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per variant (default 2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-world timeout of run_ranks, s")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",") if w.strip()]
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not names or any(v not in VARIANTS for v in names):
        ap.error(f"--variants takes names from {', '.join(VARIANTS)}")
    cfg = _config(a)
    for w in worlds:
        if a.heads % w or a.hidden % w or (4 * a.hidden) % w or a.vocab % w or a.seq % w:
            ap.error(f"heads, hidden, 4*hidden, vocab and seq must divide by world {w}")
    if a.seq != cfg["max_seq"]:
        ap.error("the position embedding has --seq rows")

    t_all = time.perf_counter()
    print(f"machine: {common.machine_line()}; load average {os.getloadavg()[0]:.2f}")
    print(f"model: gpt2-small {cfg}, batch {a.batch}, seq {a.seq}; AdamW lr 1e-3; "
          f"{a.warmup} warm-up + {a.steps} timed steps per variant, rotating")
    rows = []
    for world in worlds:
        t0 = time.perf_counter()
        plans = _plans(cfg, world, a.batch, a.seq, names)
        print(f"\n== world {world} == (planned in {time.perf_counter() - t0:.1f} s)", flush=True)
        for name, plan in plans.items():
            print(f"{name}:\n{_fmt_plan(plan)}")
        t0 = time.perf_counter()
        res = run_ranks(rank_work, world, cfg, a.batch, a.seq, plans, names, a.warmup, a.steps, timeout_s=a.timeout)
        t_run = time.perf_counter() - t0
        n_steps = len(res[0]["times"][names[0]])
        med, per_step = {}, {}
        for name in names:
            per_step[name] = [max(r["times"][name][i] for r in res) for i in range(n_steps)]  # slowest rank
            med[name] = statistics.median(per_step[name])
        pbytes = {name: max(sum(r["param_bytes"][name].values()) for r in res) for name in names}
        ref = res[0]["ref_loss"]
        base = "torch-basic" if "torch-basic" in names else names[0]
        row = {"world": world, "median_ms": {k: v * 1e3 for k, v in med.items()},
               "min_ms": {k: min(v) * 1e3 for k, v in per_step.items()},
               "param_bytes_per_rank": pbytes, "ratios": {}, "param_ratios": {},
               "loss0_vs_unsplit": {k: abs(res[0]["losses"][k][0] - ref) for k in names},
               "loss_max_vs_" + base: {k: max(abs(x - y) for x, y in zip(res[0]["losses"][k], res[0]["losses"][base]))
                                       for k in names},
               "loss_max_rank_spread": max(abs(r["losses"][n][i] - res[0]["losses"][n][i])
                                           for r in res for n in names for i in range(len(r["losses"][n]))),
               "sharded_params": {k: p.summary()["sharded_params"] for k, p in plans.items()},
               "run_s": t_run}
        print(f"{'':<14}{'median ms':>10}{'min ms':>9}{'param B/rank':>14}{'loss0 - unsplit':>17}"
              f"{'max |loss - ' + base + '|':>26}")
        for name in names:
            print(f"{name:<14}{row['median_ms'][name]:>10.1f}{row['min_ms'][name]:>9.1f}{pbytes[name]:>14,}"
                  f"{row['loss0_vs_unsplit'][name]:>17.1e}{row['loss_max_vs_' + base][name]:>26.1e}")
        for name, peers in PEERS.items():
            for peer in peers:
                if name in names and peer in names:
                    r_t = med[name] / med[peer]
                    row["ratios"][f"{name} / {peer}"] = r_t
                    line = f"  {name} / {peer}: time {r_t:.3f} ({'ok' if r_t <= 1.05 else 'MISSED'}, goal <= 1.05)"
                    if name != "autopar-free":
                        r_b = pbytes[name] / pbytes[peer]
                        row["param_ratios"][f"{name} / {peer}"] = r_b
                        line += f"; param bytes {r_b:.3f} ({'ok' if abs(r_b - 1) < 0.005 else 'MISSED'}, goal 1.00)"
                    print(line)
        print(f"(ranks ran {t_run:.1f} s; largest loss spread across ranks {row['loss_max_rank_spread']:.1e})",
              flush=True)
        rows.append(row)

    wall = time.perf_counter() - t_all
    print(f"\n{'world':>5}  {'ratio':<30}{'time':>7}{'params':>8}")
    for r in rows:
        for key, v in r["ratios"].items():
            pr = r["param_ratios"].get(key)
            print(f"{r['world']:>5}  {key:<30}{v:>7.3f}{'' if pr is None else f'{pr:>8.3f}'}")
    print(f"total wall {wall:.1f} s; load average {os.getloadavg()[0]:.2f}")
    print(json.dumps({"bench": "tp", "config": cfg, "batch": a.batch, "seq": a.seq, "steps": a.steps,
                      "warmup": a.warmup, "cores": os.cpu_count(), "torch": torch.__version__,
                      "wall_s": wall, "worlds": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
