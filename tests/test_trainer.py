"""``autopar.Trainer``: ``transformers.Trainer``'s own loop over a parallel model.

A tiny ``transformers`` Llama in float64 trains 5 SGD steps under Trainer's cosine schedule
with warm-up, weight decay, gradient clipping and per-step logging, on the same rows in order
(``train_sampling_strategy="sequential"``): once with plain ``transformers.Trainer`` in one
process (4 rows per step), and with ``autopar.Trainer`` on 2 ranks as dp=2 (2 rows per data
share) and as tp=2 (weights split, asserted), and dp=2 with one row per share accumulated over two
micro-steps. Every logged loss (Trainer keeps it in float32:
1e-6), learning rate and gradient norm must equal the single-process run's; ``save_model`` then
writes a directory ``from_pretrained`` loads with the trained weights (float64: 1e-8 of the
single-process run's); a checkpoint (``save_steps``) holds the
optimizer and scheduler under ``autopar-state/``, and resuming it under dp=2 from other initial
weights logs steps 4 and 5 as the single-process run does.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.launch import run_ranks
from tests import hf_tiny

pytest.importorskip("accelerate")

STEPS, ROWS, TOL = 5, 4, 1e-9


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(3, hf_tiny.VOCAB, (24, 8), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, rows: int, **extra):
    import transformers
    settings = dict(output_dir=out, per_device_train_batch_size=rows, max_steps=STEPS, learning_rate=0.05,
                    optim="sgd", lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5,
                    logging_steps=1, report_to=[], train_sampling_strategy="sequential", save_strategy="no",
                    use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**settings, **extra})


def _logged(trainer) -> list[tuple]:
    return [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h]


def _reference(out: str) -> tuple[list, dict]:
    import transformers
    model = hf_tiny.build("llama", torch.float64)
    trainer = transformers.Trainer(model=model, args=_args(out, ROWS), train_dataset=Rows())
    trainer.train()
    return _logged(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _case(rank: int, world: int, root: str) -> dict:
    import os

    import autopar
    torch.set_num_threads(1)
    # as torchrun starts a rank: Trainer and accelerate then run in their distributed mode (MULTI_CPU)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    out = {}
    for name, mesh, rows, opts in (("dp", {"dp": 2}, ROWS // 2, {}), ("tp", {"tp": 2}, ROWS, {"memory_budget": 1}),
                                   ("accumulated", {"dp": 2}, ROWS // 4, {})):
        model = hf_tiny.build("llama", torch.float64)
        extra = dict(save_strategy="steps", save_steps=3) if name == "tp" else \
            dict(gradient_accumulation_steps=2) if name == "accumulated" else {}
        trainer = autopar.Trainer(model, _args(f"{root}/{name}", rows, **extra), mesh=mesh,
                                  parallelize_options=opts, train_dataset=Rows())
        trainer.train()
        trainer.save_model(f"{root}/{name}/final")
        split = sum(1 for f, _ in trainer.model.named_parameters()
                    if str(trainer.model.placement_of(f)).startswith("S(")) if name == "tp" else None
        out[name] = {"logged": _logged(trainer), "split": split}
    # resumed from the tp=2 run's step-3 checkpoint under dp=2, from other initial weights: the
    # checkpoint brings the weights, the schedule's position and the data position
    model = hf_tiny.build("llama", torch.float64, seed=9)
    trainer = autopar.Trainer(model, _args(f"{root}/resumed", ROWS // 2), mesh={"dp": 2}, train_dataset=Rows())
    trainer.train(resume_from_checkpoint=f"{root}/tp/checkpoint-3")
    out["resumed"] = {"logged": _logged(trainer)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    ranks = run_ranks(_case, 2, str(root), timeout_s=500)
    return ranks, _reference(str(root / "single")), root


@pytest.mark.parametrize("name", ["dp", "tp", "accumulated"])
def test_trainer_logs_what_one_process_logs(runs, name):
    ranks, (want, _), _ = runs
    got = ranks[0][name]["logged"]
    assert [s for s, *_ in got] == [s for s, *_ in want] == list(range(1, STEPS + 1))
    for (step, loss, lr, norm), (_, loss1, lr1, norm1) in zip(got, want):
        assert loss == pytest.approx(loss1, rel=1e-6), (step, loss, loss1)    # Trainer sums its loss in float32
        assert lr == pytest.approx(lr1, rel=1e-12), (step, lr, lr1)
        assert norm == pytest.approx(norm1, rel=1e-7), (step, norm, norm1)
    if name == "tp":
        assert ranks[0]["tp"]["split"] >= 4                  # weights really were split


@pytest.mark.parametrize("name", ["dp", "tp"])
def test_save_model_writes_the_trained_weights(runs, name):
    import transformers
    _, (_, weights), root = runs
    got = transformers.AutoModelForCausalLM.from_pretrained(root / name / "final", dtype=torch.float64)
    for k, v in weights.items():
        assert torch.allclose(got.state_dict()[k], v, rtol=1e-8, atol=1e-10), k


def test_resuming_another_layouts_checkpoint_goes_on_as_one_process(runs):
    ranks, (want, _), _ = runs
    got = ranks[0]["resumed"]["logged"]          # steps 1-3 come back from the checkpoint's trainer state
    assert [s for s, *_ in got] == [1, 2, 3, 4, 5], got
    got = got[3:]
    for (step, loss, lr, norm), (_, loss1, lr1, norm1) in zip(got, want[3:]):
        assert loss == pytest.approx(loss1, rel=1e-6) and lr == pytest.approx(lr1, rel=1e-12), (step, got, want)
        assert norm == pytest.approx(norm1, rel=1e-7), (step, norm, norm1)


def test_a_checkpoint_holds_the_optimizer_and_schedule(runs):
    _, _, root = runs
    ckpt = root / "tp" / "checkpoint-3"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "autopar-state" / "LATEST").is_file()
