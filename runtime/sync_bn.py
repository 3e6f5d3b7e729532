"""BatchNorm over the whole data axis: the statistics of the global batch, as one process would
compute them (what a user of ``torch.nn.SyncBatchNorm`` expects).

Each data-axis rank holds its own rows; a training-mode BatchNorm that normalised them by their
own mean and variance would compute something the single-process model does not, and would
leave every rank with other running statistics. :func:`sync_batch_norms` rewrites each
``aten.batch_norm`` of a rank's graph into :func:`sync_batch_norm`, which in training mode
sums the row counts, then the per-channel sums, then the squared deviations from the global
mean over the data axis (differentiable all-reduces: backward sums each statistic's gradient
over the ranks, as the global batch's would), normalises with them and updates the running
statistics identically on every rank. Uneven shares are weighted by their row counts. In eval
mode it is ``aten.batch_norm`` itself.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.core.errors import UnsupportedError
from autopar.core.meta import info

__all__ = ["sync_batch_norm", "sync_batch_norms"]


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed.nn.functional import all_reduce
    return all_reduce(t, op=ReduceOp.SUM, group=group)


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                    momentum: float, eps: float, cudnn_enabled: bool, group_name: str) -> torch.Tensor:
    """``aten.batch_norm`` with training-mode statistics over the ranks of ``group_name``."""
    if not training:
        return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, False, momentum, eps,
                                                 cudnn_enabled)
    group = _resolve_process_group(group_name)
    dims = [0, *range(2, x.dim())]
    shape = [1, -1, *([1] * (x.dim() - 2))]
    count = torch.tensor([float(x.numel() // max(x.shape[1], 1))], dtype=torch.float64, device=x.device)
    torch.distributed.all_reduce(count, group=group)
    n = count.to(x.dtype)
    mean = _sum_over(x.sum(dims), group) / n
    centred = x - mean.reshape(shape)
    var = _sum_over(centred.pow(2).sum(dims), group) / n
    y = centred * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = var.detach() * (n / (n - 1)) if count.item() > 1 else var.detach()
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y


def sync_batch_norms(gm: fx.GraphModule, group_name: str) -> int:
    """Rewrite every ``aten.batch_norm`` of ``gm`` into :func:`sync_batch_norm` over the data
    axis ``group_name`` (its arguments keep their positions: train/eval switching still finds
    the ``training`` flag). Returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.batch_norm.default:
            continue
        momentum = node.args[6] if len(node.args) > 6 else None
        if not isinstance(momentum, float):
            raise UnsupportedError("a BatchNorm without a fixed momentum (momentum=None, a cumulative average) "
                                   "cannot be synchronised over the data axis",
                                   where=info(node).fqn or node.name,
                                   fix="give the BatchNorm a momentum (e.g. 0.1), or train without a data axis")
        node.target = sync_batch_norm
        node.args = (*node.args, group_name)
        count += 1
    if count:
        gm.recompile()
    return count
