"""The hand-written expert-parallel peer of bench/ep.py: the same routing, capacity and
index_put as the zoo's MoELayer, one ``all_to_all_single`` to the experts' owners (rank r owns
experts r*E/n ..), the owner's bmm on [E/n, n*C, h], one ``all_to_all_single`` back; dense
gradients averaged by one flat all_reduce, expert gradients divided by n in place."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` over dim 0; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


class HandEPLayer(nn.Module):
    """One rank's share of a ``MoELayer``: the router whole, experts ``rank*E/n ..`` only."""

    def __init__(self, src: nn.Module, rank: int, n: int, group=None, comm: bool = True) -> None:
        super().__init__()
        if src.experts % n:
            raise ValueError(f"{src.experts} experts do not split evenly over {n} ranks")
        self.experts, self.top_k, self.capacity_factor = src.experts, src.top_k, src.capacity_factor
        self.n, self.per, self.group, self.comm = n, src.experts // n, group, comm
        lo, hi = rank * self.per, (rank + 1) * self.per
        self.router = nn.Linear(src.router.in_features, src.experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(src.router.weight)
        self.w_gate = nn.Parameter(src.w_gate.detach()[lo:hi].clone())
        self.w_up = nn.Parameter(src.w_up.detach()[lo:hi].clone())
        self.w_down = nn.Parameter(src.w_down.detach()[lo:hi].clone())

    def to_owners(self, buf: torch.Tensor) -> torch.Tensor:
        """[E, C, h] of this rank's tokens -> [E/n, n*C, h] of its experts, every rank's rows."""
        c, h = buf.shape[1], buf.shape[2]
        got = _AllToAll.apply(buf, self.group) if self.comm else buf  # [n (source), E/n, C, h]
        return got.view(self.n, self.per, c, h).transpose(0, 1).reshape(self.per, self.n * c, h)

    def from_owners(self, y: torch.Tensor) -> torch.Tensor:
        """[E/n, n*C, h] of this rank's experts -> [E, C, h] of this rank's tokens."""
        c, h = y.shape[1] // self.n, y.shape[2]
        out = y.view(self.per, self.n, c, h).transpose(0, 1).reshape(self.n * self.per, c, h)
        return _AllToAll.apply(out, self.group) if self.comm else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from autopar.models.moe import expert_capacity
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        tokens = flat.shape[0]
        cap = int(expert_capacity(tokens, self.experts, self.top_k, self.capacity_factor))
        probs = F.softmax(self.router(flat).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        expert = top_i.t().reshape(-1)                              # choice-major rows
        weight = top_w.t().reshape(-1).to(x.dtype)
        onehot = (expert.unsqueeze(-1) == torch.arange(self.experts)).long()
        position = (torch.cumsum(onehot, dim=0) * onehot).sum(dim=-1) - 1
        keep = (position < cap).long()
        position, weight = position * keep, weight * keep.to(x.dtype)
        src = flat.repeat(self.top_k, 1) * keep.to(x.dtype).unsqueeze(-1)
        buf = flat.new_zeros(self.experts, cap, h).index_put((expert, position), src, accumulate=True)
        mine = self.to_owners(buf)
        gate = torch.bmm(mine, self.w_gate.transpose(1, 2))
        up = torch.bmm(mine, self.w_up.transpose(1, 2))
        back = self.from_owners(torch.bmm(F.silu(gate) * up, self.w_down.transpose(1, 2)))
        picked = back[expert, position]
        return (picked * weight.unsqueeze(-1)).view(self.top_k, tokens, h).sum(dim=0).view(b, s, h)


class HandOptimizer:
    """AdamW on the rank's parameters; before each step the dense gradients are averaged over
    the ranks by one flat all_reduce and the expert gradients divided by n in place."""

    def __init__(self, model: nn.Module, n: int, comm: bool = True, **kwargs) -> None:
        self.n, self.comm = n, comm
        self.expert = [p for m in model.modules() if isinstance(m, HandEPLayer)
                       for p in (m.w_gate, m.w_up, m.w_down)]
        ids = {id(p) for p in self.expert}
        self.dense = [p for p in model.parameters() if id(p) not in ids]
        self.optimizer = torch.optim.AdamW(model.parameters(), **kwargs)

    def step(self) -> None:
        grads = [p.grad for p in self.dense if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.comm:
            dist.all_reduce(flat)
        flat.div_(self.n)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        for p in self.expert:
            if p.grad is not None:
                p.grad.div_(self.n)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def hand_model(model: nn.Module, rank: int, n: int, comm: bool = True) -> nn.Module:
    """``model`` with each MoELayer replaced, in place, by this rank's HandEPLayer."""
    from autopar.models.moe import MoELayer
    for block in model.layers:
        if isinstance(block.mlp, MoELayer):
            block.mlp = HandEPLayer(block.mlp, rank, n, comm=comm)
    return model


# -- model, data, variants --------------------------------------------------------------------
