"""``autopar.Trainer``: ``transformers.Trainer`` over a model autopar parallelizes.

Give it the plain model and a mesh; it parallelizes the model on the first ``per_device_train_batch_size``
rows of the training set (what the data collator makes of them) and keeps Trainer's own loop:
its learning-rate schedule, gradient accumulation, logging, callbacks, ``save_steps`` and
checkpoint rotation. What changes, and why:

- **no second wrapper**: accelerate would wrap the model in DDP (``MULTI_CPU`` / ``MULTI_GPU``); the
  parallel model reduces its own gradients, so it is handed to accelerate behind a thin module
  accelerate does not recognise, and only the optimizer is prepared;
- **data by share**: every data share (dp x ep) reads its own rows, the tensor and pipeline ranks
  of one share the same rows (``autopar.data.sampler``; accelerate would give every rank other
  rows). ``per_device_train_batch_size`` is rows per data share;
- **the optimizer**: ``autopar.optimizer`` with Trainer's class, settings and weight-decay groups
  (decided on the original model's modules);
- **the columns** Trainer keeps are the original model's ``forward`` parameters;
- **clipping** by the whole model's norm (``autopar.clip_grad_norm_``);
- **saving**: ``save_model`` writes a ``from_pretrained`` directory from every mesh
  (``autopar.save_pretrained``, every rank); a checkpoint's optimizer and scheduler go through
  ``autopar.save`` (``autopar-state/`` in the checkpoint directory) and ``resume_from_checkpoint``
  reads them back, under this mesh whatever mesh wrote them.

Mixed precision is autopar's (``parallelize_options={"mixed_precision": "bf16"}``); Trainer's
``bf16``/``fp16`` flags are refused, as they would autocast around it.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn

from autopar.core.errors import ConfigError

try:
    import transformers
except ImportError as _missing:             # the hf extra
    raise ImportError("autopar.Trainer needs transformers and accelerate: pip install 'autopar[trainer]'") \
        from _missing

STATE = "autopar-state"


class _Held(nn.Module):
    """The parallel model as accelerate sees it: a module it does not wrap in DDP."""

    def __init__(self, pm: nn.Module) -> None:
        super().__init__()
        self.parallel = pm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.parallel(*args, **kwargs)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` on ``autopar.parallelize(model, mesh, ...)`` (see the module)."""

    def __init__(self, model: nn.Module, args: Any = None, *, mesh: Any, parallelize_options: dict | None = None,
                 **kwargs: Any) -> None:
        import autopar
        if args is None:
            raise ConfigError("autopar.Trainer needs TrainingArguments", where="autopar.Trainer",
                              fix="pass args=transformers.TrainingArguments(output_dir=..., ...)")
        if getattr(args, "fp16", False) or getattr(args, "bf16", False):
            raise ConfigError("Trainer's fp16/bf16 flags would autocast around the parallel model",
                              where="autopar.Trainer(args=...)", got="bf16=True" if args.bf16 else "fp16=True",
                              fix="drop them and pass parallelize_options={'mixed_precision': 'bf16'} (or 'fp16')")
        train = kwargs.get("train_dataset")
        if train is None or not hasattr(train, "__len__") or not hasattr(train, "__getitem__"):
            raise ConfigError("autopar.Trainer needs a map-style train_dataset (it parallelizes the model on its "
                              "first rows)", where="autopar.Trainer(train_dataset=...)",
                              got=type(train).__name__, fix="pass a dataset with __len__ and __getitem__")
        self._source = model
        self._source_forward = inspect.signature(model.forward)
        collator = kwargs.get("data_collator") or transformers.default_data_collator
        rows = min(args.per_device_train_batch_size, len(train))
        example = collator([train[i] for i in range(rows)])
        keep = set(self._source_forward.parameters)
        example = {k: v for k, v in example.items() if k in keep and isinstance(v, torch.Tensor)}
        device = next(model.parameters()).device
        example = {k: v.to(device) for k, v in example.items()}
        pm = autopar.parallelize(model, mesh, example_kwargs=example, **dict(parallelize_options or {}))
        pm.config = getattr(model, "config", None)
        self._autopar_optimizer = None
        super().__init__(model=pm, args=args, **kwargs)
        self.model_accepts_loss_kwargs = False        # the parallel model takes the inputs it was captured with

    # -- the model as accelerate sees it; the columns; the batch size --------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return model if isinstance(model, _Held) else _Held(model)

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            self._signature_columns = list(self._source_forward.parameters) + list(
                {"label", "label_ids", *self.label_names})

    def _shares(self) -> int:
        import autopar
        return autopar.data.batch_share(self.model).count

    def get_total_train_batch_size(self, args: Any) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self._shares()

    # -- data: each share its rows -------------------------------------------------------------------------
    def _loader(self, dataset: Any, batch_size: int, description: str, training: bool) -> torch.utils.data.DataLoader:
        import autopar
        collator = self.data_collator
        try:
            import datasets
            hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            hf_dataset = False
        if hf_dataset:
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        shuffle = training and self.args.train_sampling_strategy != "sequential"
        sampler = autopar.data.sampler(dataset, self.model, shuffle=shuffle, seed=self.args.seed,
                                       drop_last=self.args.dataloader_drop_last or training)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator,
                                           drop_last=self.args.dataloader_drop_last,
                                           num_workers=self.args.dataloader_num_workers,
                                           pin_memory=self.args.dataloader_pin_memory)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.train_dataset is None:
            raise ConfigError("training needs a train_dataset", where="autopar.Trainer.train")
        return self._loader(self.train_dataset, self._train_batch_size, "Training", True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ConfigError("evaluation needs an eval_dataset", where="autopar.Trainer.evaluate")
        return self._loader(dataset, self.args.eval_batch_size, "Evaluation", False)

    # -- the optimizer and clipping ----------------------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        import autopar
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(self._source))
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            cls, settings = self.get_optimizer_cls_and_kwargs(self.args, self._source)
            settings = {k: v for k, v in settings.items() if k not in ("fused", "foreach")}
            self.optimizer = autopar.optimizer(self.model, cls, groups, **settings)
        self._autopar_optimizer = self.optimizer
        return self.optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        import autopar
        return autopar.clip_grad_norm_(self.model, self._autopar_optimizer, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        import autopar
        if grad_norm is None:
            grad_norm = autopar.clip_grad_norm_(self.model, self._autopar_optimizer, float("inf"))
        return grad_norm

    # -- saving and resuming -------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        import autopar
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        autopar.save_pretrained(self.model, output_dir)          # every rank; rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        import shutil

        import torch.distributed as dist

        import autopar
        state = os.path.join(output_dir, STATE)
        # Trainer writes checkpoint-N over an earlier run's (its weights included): so does the state
        if os.path.isdir(state) and (not dist.is_initialized() or dist.get_rank() == 0):
            shutil.rmtree(state)
        if dist.is_initialized():
            dist.barrier()
        autopar.save(self.model, self._autopar_optimizer, state, step=self.state.global_step,
                     scheduler=self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        import autopar
        autopar.load(self.model, None, resume_from_checkpoint)      # the weights, a transformers directory

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        import autopar
        if checkpoint is not None:
            autopar.load(self.model, self._autopar_optimizer, os.path.join(checkpoint, STATE),
                         scheduler=self.lr_scheduler)

    def _save_scaler(self, output_dir: str) -> None:
        return None                               # fp16 loss scaling lives in autopar's optimizer state

    def _load_scaler(self, checkpoint: str | None) -> None:
        return None


__all__ = ["Trainer"]
