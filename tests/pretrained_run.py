"""Run under ``torchrun --nproc-per-node 2`` by tests/test_pretrained.py: a tiny
``transformers`` Llama on tp=2 (weights split) trains three steps under ``LambdaLR`` and four
under ``get_cosine_schedule_with_warmup``, writes a Hugging Face directory with
``autopar.save_pretrained`` and, on rank 0, its logits and learning rates to ``result.pt``."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    import transformers

    import autopar
    from tests import hf_tiny
    autopar.init_distributed()
    torch.set_num_threads(1)
    model, data = hf_tiny.build("llama"), hf_tiny.batch(rows=4, seq=8)
    pm = autopar.parallelize(model, {"tp": 2}, example_kwargs=data, memory_budget=1)
    split = sum(1 for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S("))
    opt = autopar.optimizer(pm, torch.optim.AdamW, lr=1e-3)
    lrs = []
    for schedule, steps in ((torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)), 3),
                            (transformers.get_cosine_schedule_with_warmup(opt, 2, 6), 4)):
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            pm(**data).loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
    autopar.save_pretrained(pm, out / "hf")
    with torch.no_grad():
        logits = pm(**data).logits
    if dist.get_rank() == 0:
        torch.save({"logits": logits.detach().cpu(), "lrs": lrs, "split": split}, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
