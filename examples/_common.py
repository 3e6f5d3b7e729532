"""What both example scripts share: the command line, the data, the learning-rate schedule
and the training loop with checkpoints. Each script builds its model and calls :func:`train`.

The loop is what a user of autopar writes around ``autopar.parallelize``:

- the mesh and the parallel options come from ``--plan plan.json`` (written by
  ``autopar plan ... --save-plan``, scaled to the ranks ``torchrun`` started) or ``--mesh``;
- each rank reads its data share (``autopar.data.sampler``): data-parallel and expert ranks
  read different windows of the text, tensor and pipeline ranks of one replica the same;
- the learning rate warms up linearly, then decays along a cosine to a tenth of its peak;
- gradients are clipped to ``--clip`` by the norm of the whole model's gradient
  (``autopar.clip_grad_norm_``, correct when each rank holds only pieces of it);
- every ``--ckpt-every`` steps, and at the end, ``autopar.save`` writes a checkpoint;
  ``--resume`` reads the newest one back (under any mesh) and goes on from its step, with the
  data order and the learning rate of that step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "corpus.txt"
VOCAB = 256            # the text is read as bytes: token = byte value


def arguments(description: str, default_mesh: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--plan", help="a plan file from `autopar plan ... --save-plan FILE`, scaled to these ranks")
    ap.add_argument("--mesh", default=default_mesh, help=f"without --plan: axes and sizes, e.g. dp=2,tp=2 "
                    f"(default {default_mesh}); their product is the rank count")
    ap.add_argument("--zero", type=int, default=None, help="without --plan: ZeRO stage 0-3")
    ap.add_argument("--batch", type=int, default=4, help="without --plan: rows per data share per step")
    ap.add_argument("--seq", type=int, default=32, help="tokens per row")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a resumed run counts from 0)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    ap.add_argument("--data", default=str(CORPUS), help="a text file (read as bytes)")
    ap.add_argument("--ckpt-dir", help="write checkpoints here")
    ap.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    ap.add_argument("--resume", action="store_true", help="start from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--log-jsonl", help="rank 0 appends one JSON line per step here")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def init() -> torch.device:
    """The process group torchrun describes: NCCL with one GPU per rank when there are GPUs, gloo
    on CPUs."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def layout(args) -> tuple[dict, dict, int, int]:
    """(mesh, parallelize options, micro-batch rows, micro-batches per step) from --plan or --mesh."""
    if args.plan:
        scaled = autopar.scale_plan(args.plan)
        return scaled.mesh, {"plan": args.plan}, scaled.micro_batch, scaled.microbatches
    mesh = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
    opts = {"zero_stage": args.zero} if args.zero is not None else {}
    if "pp" in mesh:
        opts.update(options=autopar.PipelineOptions(schedule="1f1b", microbatches=2))
        return mesh, opts, args.batch // 2, 2
    return mesh, opts, args.batch, 1


class TextWindows(torch.utils.data.Dataset):
    """The text cut into rows of ``seq`` consecutive bytes."""

    def __init__(self, path: str, seq: int) -> None:
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        self.rows = data[:len(data) // seq * seq].view(-1, seq)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def cosine_lr(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def batches(dataset, mesh: dict, rows: int, seed: int, start: int):
    """This rank's batches of ``rows`` rows from step ``start`` on, epoch after epoch."""
    sampler = autopar.data.sampler(dataset, mesh, seed=seed)
    per_epoch = len(sampler) // rows
    if per_epoch < 1:
        raise SystemExit(f"the text gives each data share {len(sampler)} rows, fewer than {rows} per step")
    step = start
    while True:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=rows, sampler=sampler, drop_last=True)
        for i, rows_ in enumerate(loader):
            if i >= skip:
                yield rows_
                step += 1


def train(model: torch.nn.Module, args, device: torch.device) -> None:
    """Parallelize ``model`` as ``args`` say and train it (see the module docstring)."""
    rank = dist.get_rank()
    mesh, opts, micro, m = layout(args)
    dataset = TextWindows(args.data, args.seq)
    rows = micro * m
    model.to(device)
    example = dataset[0].repeat(rows, 1).to(device)
    pm = autopar.parallelize(model, None if args.plan else mesh,
                             example_kwargs={"input_ids": example, "labels": example}, **opts)
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    start = 0
    shares = autopar.data.batch_share(mesh).count
    run = {"schedule_steps": args.steps, "global_rows": rows * shares}
    if args.resume:
        state = autopar.load(pm, opt, args.ckpt_dir)
        start = int(state["step"])
        saved = state["extra"] or {}
        if rank == 0:
            print(f"resumed from {args.ckpt_dir} at step {start}", flush=True)
        if saved.get("schedule_steps", args.steps) != args.steps:
            run["schedule_steps"] = saved["schedule_steps"]        # the schedule keeps its length
            if rank == 0:
                print(f"NOTE: the learning-rate schedule keeps the length it was saved with "
                      f"({saved['schedule_steps']} steps); --steps {args.steps} only says where this run stops",
                      flush=True)
        want = saved.get("global_rows", rows * shares)
        if want != rows * shares:
            per = want // shares
            if want % shares == 0 and per % m == 0:       # keep the global batch: each share takes its part
                if rank == 0:
                    print(f"NOTE: keeping the saved run's global batch of {want} rows per step: {shares} data "
                          f"share(s) of {per} rows each (the options here gave {rows})", flush=True)
                rows, micro = per, per // m
            elif rank == 0:
                print(f"WARNING: the global batch changes from {want} to {rows * shares} rows per step: {want} rows "
                      f"do not split into {shares} data share(s) of {m} micro-batch(es)", flush=True)
            run["global_rows"] = rows * shares
    schedule = argparse.Namespace(**{**vars(args), "steps": run["schedule_steps"]})
    pipelined = "pp" in mesh
    if rank == 0:
        print(f"mesh {mesh}, {m} micro-batch(es) of {micro} rows per data share, "
              f"{autopar.data.batch_share(mesh).count} share(s), seq {args.seq}", flush=True)
    log = open(args.log_jsonl, "a") if args.log_jsonl and rank == 0 else None
    data = batches(dataset, mesh, rows, args.seed, start)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, schedule)
        rows_ = next(data).to(device)
        batch = {"input_ids": rows_, "labels": rows_}      # the model shifts the labels itself
        if pipelined:
            loss = pm.step(**batch).detach()
        else:
            loss = torch.zeros((), device=device)
            for piece in zip(*(v.chunk(m) for v in batch.values())):
                part = pm(**dict(zip(batch, piece))).loss / m
                part.backward()
                loss += part.detach()
        norm = autopar.clip_grad_norm_(pm, opt, args.clip)
        opt.step()
        opt.zero_grad()
        loss = loss.float().clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()      # tensor and pipeline ranks hold their replica's loss
        seconds = time.perf_counter() - t0
        scaler = getattr(opt, "scaler", None)
        skipped = scaler is not None and not math.isfinite(norm.item())
        if rank == 0:
            print(f"step {step + 1:>4}  loss {loss.item():.4f}  "
                  + (f"skipped: fp16 overflow, loss scale now {scaler.scale:g}" if skipped else
                     f"grad norm {norm.item():.3f}")
                  + f"  lr {cosine_lr(step, schedule):.2e}  {seconds * 1e3:.0f} ms", flush=True)
            if log:
                log.write(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": norm.item(),
                                      "lr": cosine_lr(step, schedule), "step_s": seconds}) + "\n")
                log.flush()
        done = step + 1
        if args.ckpt_dir and (done == args.steps or (args.ckpt_every and done % args.ckpt_every == 0)):
            autopar.save(pm, opt, args.ckpt_dir, step=done, extra=run)
            if rank == 0:
                print(f"saved {args.ckpt_dir} at step {done}", flush=True)
    if log:
        log.close()
    dist.destroy_process_group()
