"""Benchmark: per-rank memory of ZeRO-0..3 inside a pipeline, measured vs cost/hybrid's prediction.

Command:  python bench/pp_memory.py [--zero 0 1 2 3] [--set k=v ...] [--micro-batch 2]
                                    [--microbatches 4] [--seq 128]

Four gloo ranks on this machine's CPU (``run_ranks``, one thread per rank), mesh
``{"pp": 2, "dp": 2}``, the zoo GPT (default 4 layers, hidden 256, 4 heads, vocab 1024) in
float32, each data rank on its own ``micro_batch * microbatches`` rows. Per ZeRO stage every
rank builds the model from the same seed, runs ``autopar.parallelize(model, mesh, local,
loss_fn=cross_entropy, schedule="1f1b", microbatches=M, zero_stage=z)`` with
``autopar.optimizer(pm, AdamW)``, one warm-up step (``pm.step``, ``opt.step``,
``opt.zero_grad``: the optimizer state exists from then on) and one measured step.

What a rank holds is counted from its tensors, each storage once (a view counts its storage):

- params: the stages' parameters (whole during a step; ZeRO-3's are empty between steps), the
  module's parameters (ZeRO-3: the flat pieces, which are also the optimizer's masters) and the
  optimizer's masters (fp32 ZeRO-1/2: views into the parameters, so nothing extra);
- grads: ``.grad`` of all of those and the data-axis gradient sinks (``pm.dp_runtimes[*].sinks``);
- optimizer: the optimizer's state tensors (AdamW's two moments and step counters);
- activations: what autograd saves between forward and backward during ``pm.step``: a
  ``saved_tensors_hooks`` pair around the step boxes every saved tensor and counts its storage
  (not a parameter's) while any box of it is alive, so a storage is released when the schedule's
  backward frees the last node that saved it.

The rank's total is sampled at every saved tensor (activations only grow there), when each data
axis finishes its step (all backward done, whole gradients still held) and just before the inner
optimizer steps (ZeRO-1's reduce-scattered gradient pieces sit beside the whole gradients there);
the table shows, per ZeRO stage and pipeline rank, the terms at the moment of that rank's largest
total. Buffers the collectives hold while in flight (a bucket's flat or row copy of its gradients,
from the stage's last backward to the step's end; ZeRO-3's gather buffers before the first
micro-batch) are not counted, neither here nor by the simulator.

The prediction is ``cost.hybrid.simulate`` for the same configuration: ``ModelFacts`` of the
same GPT captured as ``autopar.cli.train.choose`` does (``load_workload`` / ``capture_for_planning``,
dtype fp32), ``Cluster.from_spec("1x4", hardware="cpu")``, ``Config(dp=2, tp=1, pp=2,
micro_batch=b, schedule="1f1b", zero_stage=z)`` at global batch ``2 * b * M``. The simulator's
memory is per device, the largest over the pipeline ranks; ratios compare it with the measured
rank of the largest total (the two data ranks of a pipeline rank hold the same, within bytes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
import weakref

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # after the filter above

import _common as common  # noqa: E402 - bench/ is the script directory

TERMS = ("params", "grads", "optimizer", "activations")
DEFAULT = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024, "max_seq": 128}
GOAL = 0.10            # |measured / predicted - 1| for ZeRO-3's total


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


class _Box:
    """What the pack hook hands autograd instead of a saved tensor; its death releases the count."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Meter:
    """Counts one rank's tensors (module docstring) and keeps the terms at the largest total."""

    def __init__(self, pm, opt) -> None:
        self.pm, self.opt = pm, opt
        self.live: dict[int, list[int]] = {}      # saved storage -> [bytes, live boxes]
        self.acts = 0
        self.peak: dict[str, int] = {t: 0 for t in TERMS}
        self.peak_acts = 0
        self.samples = 0

    def held(self) -> tuple[dict[str, int], set[int]]:
        """Bytes per term of the tensors the rank holds now (not activations), and the storages
        of the parameters (whose saved views are not activations)."""
        owner: dict[int, tuple[str, int]] = {}

        def claim(term: str, t) -> None:
            if not isinstance(t, torch.Tensor):
                return
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in owner:
                owner[s.data_ptr()] = (term, s.nbytes())

        pm, opt = self.pm, self.opt
        params = [p for st in pm.stages for p in st.parameters()] + list(pm.parameters()) + \
            list(getattr(opt, "masters", {}).values())
        for p in params:
            claim("params", p)
        for p in params:
            claim("grads", p.grad)
        for rt in pm.dp_runtimes:
            for g in rt.sinks.values():
                claim("grads", g)
        for state in opt.state.values():
            for v in state.values():
                claim("optimizer", v)
        out = {t: 0 for t in TERMS}
        for term, nbytes in owner.values():
            out[term] += nbytes
        return out, {ptr for ptr, (term, _) in owner.items() if term == "params"}

    def sample(self) -> None:
        now, _ = self.held()
        now["activations"] = self.acts
        self.samples += 1
        if sum(now.values()) > sum(self.peak.values()):
            self.peak = now

    # -- saved tensors -------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        _, param_ptrs = self.held()
        if ptr in param_ptrs or s.nbytes() == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [s.nbytes(), 0]
            self.acts += s.nbytes()
            self.peak_acts = max(self.peak_acts, self.acts)
        entry[1] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, ptr)
        self.sample()
        return box

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.acts -= entry[0]
            del self.live[ptr]

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Box) else x


def _instrumented_step(pm, opt, local, target) -> Meter:
    """One training step of ``pm`` with a :class:`Meter` sampling it."""
    meter = Meter(pm, opt)
    axes = pm.data_axes
    originals = [d.end_step for d in axes]
    for d, original in zip(axes, originals):
        def end_step(original=original) -> None:
            meter.sample()              # every backward done, the whole gradients still held
            original()
        d.end_step = end_step
    hook = opt.inner.register_step_pre_hook(lambda *_: meter.sample())
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            pm.step(*local, target=target)
        opt.step()
    finally:
        hook.remove()
        for d in axes:
            del d.end_step              # back to the class's method
    opt.zero_grad()
    if meter.live:
        raise RuntimeError(f"{len(meter.live)} saved storages outlived the step")
    return meter


def rank_work(rank: int, world: int, overrides: dict, zeros: list[int], micro: int, microbatches: int,
              seq: int) -> list[dict]:
    import torch.distributed as dist

    import autopar
    from autopar import models

    torch.set_num_threads(1)
    dp = 2
    out = []
    for z in zeros:
        torch.manual_seed(0)
        model = models.build("gpt", overrides, device="cpu")
        torch.manual_seed(1)
        rows = micro * microbatches
        args, _ = models.example_inputs(model, rows * dp, seq, device="cpu")
        target = torch.randint(0, model.config.vocab, (rows * dp, seq))
        share = rank % dp                     # {"pp": 2, "dp": 2}: dp is the inner axis
        local, local_t = tuple(a.chunk(dp)[share] for a in args), target.chunk(dp)[share]
        pm = autopar.parallelize(model, {"pp": 2, "dp": dp}, local, zero_stage=z, options=autopar.PipelineOptions(
            loss_fn=_loss, schedule="1f1b", microbatches=microbatches))
        opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
        pm.step(*local, target=local_t)
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        meter = _instrumented_step(pm, opt, local, local_t)
        dist.barrier()
        out.append({"zero": z, "rank": rank, "pp_rank": pm.pp_rank, "peak": meter.peak,
                    "peak_activations": meter.peak_acts, "samples": meter.samples,
                    "step_s": time.perf_counter() - t0, "plan_zero": pm.plan.zero_stage,
                    "stages": [st.index for st in pm.stages],
                    "stage_params": sum(p.numel() for st in pm.stages for p in st.parameters())})
    return out


def predict(overrides: dict, zeros: list[int], micro: int, microbatches: int, seq: int) -> dict[int, dict]:
    """``cost.hybrid.simulate``'s memory for the same configurations (module docstring)."""
    from autopar.cost.cluster import Cluster
    from autopar.cost.hybrid import Config, ModelFacts, simulate
    from autopar.cli.workload import capture_for_planning, load_workload

    batch = 2 * micro * microbatches
    w = load_workload("gpt", batch=batch, seq=seq, overrides={k: str(v) for k, v in overrides.items()})
    planned = capture_for_planning(w)
    facts = ModelFacts(planned.gm, seq=seq, dtype="fp32", layers=planned.block_copies)
    cluster = Cluster.from_spec("1x4", hardware="cpu")
    out = {}
    for z in zeros:
        score = simulate(facts, cluster, Config(dp=2, tp=1, pp=2, micro_batch=micro, schedule="1f1b",
                                                zero_stage=z), batch=batch)
        out[z] = dict(score.memory)
    return out


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> int:
    from autopar.runtime.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO stages (default 0 1 2 3)")
    ap.add_argument("--set", action="append", metavar="K=V", help="model overrides (default %s)" % DEFAULT)
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch (default 2)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--timeout", type=float, default=300.0, help="run_ranks timeout, s")
    a = ap.parse_args()
    overrides = {k: int(v) for k, v in common.overrides(a.set, DEFAULT).items()}
    t_all = time.perf_counter()
    print(f"machine: {common.machine_line()}")
    print(f"model: gpt {overrides}, fp32; mesh pp=2 x dp=2, 1f1b, {a.microbatches} micro-batches of "
          f"{a.micro_batch} x {a.seq} per data rank; AdamW")
    t0 = time.perf_counter()
    predicted = predict(overrides, a.zero, a.micro_batch, a.microbatches, a.seq)
    predict_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ranks = run_ranks(rank_work, 4, overrides, a.zero, a.micro_batch, a.microbatches, a.seq, timeout_s=a.timeout)
    run_s = time.perf_counter() - t0
    rows = [r for rank in ranks for r in rank]
    print("\nmeasured per rank, MiB: the terms at the moment of the rank's largest total")
    print("| ZeRO | rank | pp rank | params | grads | optimizer | activations | total |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["zero"], r["rank"])):
        p = r["peak"]
        print(f"| {r['zero']} | {r['rank']} | {r['pp_rank']} | " + " | ".join(_mib(p[t]) for t in TERMS) +
              f" | {_mib(sum(p.values()))} |")
    print("\nper device (the rank of the largest total), MiB: measured / predicted")
    print("| ZeRO | params | grads | optimizer | activations | total | ratio |")
    print("|---|---|---|---|---|---|---|")
    summary = []
    for z in a.zero:
        worst = max((r for r in rows if r["zero"] == z), key=lambda r: sum(r["peak"].values()))
        m, p = worst["peak"], predicted[z]
        ratio = sum(m.values()) / sum(p.values())
        summary.append({"zero": z, "rank": worst["rank"], "measured": m, "predicted": p, "ratio": ratio})
        print(f"| {z} | " + " | ".join(f"{_mib(m[t])} / {_mib(p[t])}" for t in TERMS) +
              f" | {_mib(sum(m.values()))} / {_mib(sum(p.values()))} | {ratio:.3f} |")
    z3 = next((s for s in summary if s["zero"] == 3), None)
    if z3 is not None:
        ok = abs(z3["ratio"] - 1) <= GOAL
        print(f"\nZeRO-3 total measured / predicted {z3['ratio']:.3f}: "
              f"{'within' if ok else 'OUTSIDE'} {GOAL:.0%}")
    wall = time.perf_counter() - t_all
    print(f"prediction {predict_s:.1f}s, ranks {run_s:.1f}s, whole run {wall:.1f}s")
    print(json.dumps({"bench": "pp_memory", "overrides": overrides, "micro_batch": a.micro_batch,
                      "microbatches": a.microbatches, "seq": a.seq, "rows": rows, "summary": summary,
                      "wall_s": wall}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
