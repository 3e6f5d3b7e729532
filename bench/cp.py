"""Context parallelism on CPU ranks: a small ``transformers`` Llama at long sequences, cp = 1, 2, 4.

For each sequence length and cp degree, and for each kind (ring, all-gather, all-to-all over
heads), gloo ranks train the model through ``autopar.parallelize(model, {"cp": cp})`` on their
load-balanced tokens of one sequence and report, per rank (the largest over the ranks):

- **activation bytes**: what autograd keeps for backward in one forward, by unique storage
  (``torch.autograd.graph.saved_tensors_hooks``), against cp = 1 (goal: 1/cp within 10 %);
- **step time**: the median of the timed steps (forward, backward, SGD), the ranks aligned by a
  barrier; the ranks share this machine's cores, so cp > 1 runs cp processes on them;
- **bytes sent** per step by the context-parallel exchanges (``autopar.runtime.cp.sent_bytes``: the
  payload a ring algorithm moves; on gloo autopar sends a gather as an all-reduce, twice that).

The peer is torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``): its
ring attention is tried on the same model and ranks; where it does not run on CPU the table says
why (the error it raises).

    python bench/cp.py [--seq 4096 8192] [--cp 1 2 4] [--steps 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.runtime.launch import run_ranks  # noqa: E402
from bench._common import machine_line  # noqa: E402

CONFIG = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256, vocab_size=256, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _model(seq: int):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG, max_position_embeddings=seq)
    return transformers.LlamaForCausalLM(cfg)


def _batch(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn()`` runs forward (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _autopar(rank: int, world: int, seq: int, kind: str, steps: int) -> dict:
    import autopar
    from autopar.runtime import cp as cp_runtime
    torch.set_num_threads(1)
    mesh = {"cp": world}
    part = autopar.data.shard(_batch(seq), mesh)
    pm = autopar.parallelize(_model(seq), mesh, example_kwargs=part,
                             options=[autopar.ContextOptions(kind=kind)] if world > 1 else None)
    opt = autopar.optimizer(pm, torch.optim.SGD, lr=1e-3)
    times, acts, sent = [], 0, []
    for step in range(steps + 1):
        dist.barrier()
        cp_runtime.sent_bytes()
        t0 = time.perf_counter()
        acts, out = _saved_bytes(lambda: pm(**part).loss)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:                        # the first step warms up
            times.append(time.perf_counter() - t0)
            sent.append(cp_runtime.sent_bytes())
    return {"acts": acts, "step_s": statistics.median(times), "sent": statistics.median(sent),
            "kind": pm.plan.cp_kind if world > 1 else "-"}


def _torch_peer(rank: int, world: int, seq: int, steps: int) -> dict:
    """torch's context_parallel (ring attention through DTensor) on the same model, if it runs."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    try:
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        model = _model(seq)
        model.config._attn_implementation = "sdpa"
        data = _batch(seq)
        pos = torch.arange(seq)[None]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        times, acts = [], 0
        for step in range(steps + 1):
            ids, labels, where = data["input_ids"].clone(), data["labels"].clone(), pos.clone()
            dist.barrier()
            t0 = time.perf_counter()
            with context_parallel(mesh, buffers=[ids, labels, where], buffer_seq_dims=[1, 1, 1]):
                acts, out = _saved_bytes(lambda: model(input_ids=ids, labels=labels, position_ids=where,
                                                       use_cache=False).loss)
                out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step:
                times.append(time.perf_counter() - t0)
        return {"acts": acts, "step_s": statistics.median(times), "error": ""}
    except Exception as exc:  # noqa: BLE001 - the peer's failure is a result to report
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--kinds", nargs="+", default=["ring", "allgather", "alltoall"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (default 3, after one warm-up)")
    ap.add_argument("--no-peer", action="store_true", help="skip torch's context_parallel")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for seq in args.seq:
        base = None
        for cp in args.cp:
            for kind in (args.kinds if cp > 1 else ["-"]):
                got = run_ranks(_autopar, cp, seq, kind, args.steps, timeout_s=3600)
                acts = max(g["acts"] for g in got)
                base = acts if cp == 1 else base
                rows.append({"seq": seq, "cp": cp, "kind": kind, "acts": acts,
                             "acts_ratio": acts / base if base else None, "step_s": max(g["step_s"] for g in got),
                             "sent": max(g["sent"] for g in got), "system": "autopar"})
                print(_line(rows[-1]), flush=True)
            if cp > 1 and not args.no_peer:
                got = run_ranks(_torch_peer, cp, seq, args.steps, timeout_s=3600)
                errs = [g["error"] for g in got if g["error"]]     # the cause, not a peer's lost connection
                err = next((e for e in errs if "Connection" not in e), errs[0] if errs else "")
                row = {"seq": seq, "cp": cp, "kind": "torch ring", "system": "torch", "error": err}
                if not err:
                    row.update(acts=max(g["acts"] for g in got), step_s=max(g["step_s"] for g in got),
                               acts_ratio=max(g["acts"] for g in got) / base if base else None, sent=None)
                rows.append(row)
                print(_line(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"machine": machine_line(), "rows": rows}, indent=1))
    else:
        print(f"\n{machine_line()}\n")
        print("| seq | cp | kind | activations per rank (MB) | x cp=1 | step (s) | sent per step (MB) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(_row(r))
    return 0


def _line(r: dict) -> str:
    if r.get("error"):
        return f"seq {r['seq']} cp {r['cp']} {r['kind']}: does not run: {r['error']}"
    ratio = f" ({r['acts_ratio']:.3f} of cp=1)" if r.get("acts_ratio") else ""
    sent = f", sent {r['sent'] / 1e6:.1f} MB" if r.get("sent") is not None else ""
    return f"seq {r['seq']} cp {r['cp']} {r['kind']}: activations {r['acts'] / 1e6:.1f} MB{ratio}, step {r['step_s']:.2f} s{sent}"


def _row(r: dict) -> str:
    if r.get("error"):
        return f"| {r['seq']} | {r['cp']} | {r['kind']} | does not run on CPU: {r['error']} | | | |"
    ratio = f"{r['acts_ratio']:.3f}" if r.get("acts_ratio") else "1"
    sent = f"{r['sent'] / 1e6:.1f}" if r.get("sent") is not None else "-"
    return (f"| {r['seq']} | {r['cp']} | {r['kind']} | {r['acts'] / 1e6:.1f} | {ratio} | {r['step_s']:.2f} | "
            f"{sent} |")


if __name__ == "__main__":
    sys.exit(main())
