"""Expert-parallel runtime: the all-to-all token exchange around a mixture-of-experts layer.

Each rank of the expert axis routes its own tokens into a fixed-capacity buffer
``[E, C, h]`` (exactly as the single-device model does for those tokens) and owns ``E/n``
experts. :func:`dispatch` sends every expert's rows to the rank that owns it; the owner
runs its experts on ``[E/n, n*C, h]`` (the rows of all ranks side by side) and
:func:`combine` sends the results back, so each rank reads its tokens' outputs from a
``[E, C, h]`` buffer again. The expert order ``perm`` puts the experts a rank owns next
to each other: rank ``r`` owns ``perm[r*E/n:(r+1)*E/n]`` (the placement the planner chose).
Both are autograd functions whose backward is the opposite exchange. The graph calls them
as ``autopar_ep_dispatch(x, rid)`` / ``autopar_ep_combine(y, rid)`` nodes.

Dropless layers (every routed token is computed, as current model libraries route) go through
one graph node, ``autopar_ep_moe(x, ids, weights, params, lid)`` (:class:`DroplessMoE`): each
(token, choice) pair is sent to the rank owning its expert, with the per-rank counts
exchanged first so the all-to-all can use variable split sizes; the owner runs each of its
experts on the rows it received, the outputs travel back the same way, and the token's
output is the routing-weighted sum of its choices. The all-to-all's backward is the reverse
all-to-all, so the gradients of the tokens, the weights and the experts are exact. The tokens
go in chunks whose exchanges are started asynchronously, so one chunk's all-to-all travels
while another's experts compute, in forward and in backward.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.core.options import DISPATCH_CHUNKS
from autopar.runtime.pp_overlap import lane_group

_RUNTIMES: dict[int, "EPRuntime"] = {}
_IDS = itertools.count()


@dataclass
class EPRuntime:
    """One expert axis: its group, this rank's place on it, and the expert order."""

    n: int
    rank: int
    group: dist.ProcessGroup | None
    perm: tuple[int, ...]            # expert ids in owner order
    chunks: int = DISPATCH_CHUNKS    # dropless layers: token chunks whose exchanges overlap (DroplessMoE)
    node_ranks: int = 0              # two-hop dropless exchange: ep ranks per node (0: one hop)
    intra: dist.ProcessGroup | None = None    # ... this rank's node's ep ranks (node_ranks of them)
    rail: dist.ProcessGroup | None = None     # ... the ep ranks at this rank's place on every node
    fold: int = 1                    # dropless layers folded over the tensor axis: its size (group spans ep x tp)
    fold_group: dist.ProcessGroup | None = None   # ... the tensor axis's group, on which the tokens are shared out
    fold_rank: int = 0               # ... this rank's place on it
    id: int = -1

    def __post_init__(self) -> None:
        self.id = next(_IDS)
        _RUNTIMES[self.id] = self
        self.inverse = tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i]))
        self._perm_t = torch.tensor(self.perm)
        self._inv_t = torch.tensor(self.inverse)
        self._identity = list(self.perm) == sorted(self.perm)   # experts in order: no reordering copies

    @property
    def experts(self) -> int:
        return len(self.perm)

    def owned(self, rank: int | None = None) -> tuple[int, ...]:
        per = self.experts // self.n
        r = self.rank if rank is None else rank
        return self.perm[r * per:(r + 1) * per]

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=lane_group(self.group))
        return out

    # [E, C, h] in expert order -> [E/n, n*C, h] of this rank's experts
    def to_owners(self, x: torch.Tensor) -> torch.Tensor:
        e, c = x.shape[0], x.shape[1]
        rest = x.shape[2:]
        per = e // self.n
        ordered = x if self._identity else x.index_select(0, self._perm_t.to(x.device))
        got = self._exchange(ordered)                                        # [n(src) * per, C, ...]
        return got.reshape(self.n, per, c, *rest).transpose(0, 1).reshape(per, self.n * c, *rest)

    # [E/n, n*C, h] of this rank's experts -> [E, C, h] in expert order
    def from_owners(self, y: torch.Tensor) -> torch.Tensor:
        per, nc = y.shape[0], y.shape[1]
        rest = y.shape[2:]
        c = nc // self.n
        out = y.reshape(per, self.n, c, *rest).transpose(0, 1).reshape(self.n * per, c, *rest)
        back = self._exchange(out)                                           # [E (owner order), C, ...]
        return back if self._identity else back.index_select(0, self._inv_t.to(y.device))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rid: int) -> torch.Tensor:
        ctx.rid = rid
        return _RUNTIMES[rid].to_owners(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RUNTIMES[ctx.rid].from_owners(grad), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, rid: int) -> torch.Tensor:
        ctx.rid = rid
        return _RUNTIMES[rid].from_owners(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _RUNTIMES[ctx.rid].to_owners(grad), None


def autopar_ep_dispatch(x: torch.Tensor, rid: int) -> torch.Tensor:
    """Send each expert's buffer rows to its owner (graph node)."""
    return _Dispatch.apply(x, rid)


def autopar_ep_combine(y: torch.Tensor, rid: int) -> torch.Tensor:
    """Send the experts' outputs back to the ranks whose tokens they are (graph node)."""
    return _Combine.apply(y, rid)


class _Pending:
    """One all-to-all in flight: started by :class:`_Start`, waited on by :class:`_Wait` (and
    the other way round in backward, so both directions overlap alike)."""

    def __init__(self, send: list[int], recv: list[int], group) -> None:
        self.send, self.recv, self.group = send, recv, group
        self.work = None
        self.out: torch.Tensor | None = None

    def start(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        self.out = x.new_empty((sum(recv), *x.shape[1:]))
        self.work = dist.all_to_all_single(self.out, x.contiguous(), output_split_sizes=recv,
                                           input_split_sizes=send, group=lane_group(self.group), async_op=True)
        self._keep = x          # alive until the exchange is done
        return self.out

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        out, self.work, self.out, self._keep = self.out, None, None, None
        return out


class _Start(torch.autograd.Function):
    """Forward: start sending ``x``'s rows (``send`` counts out, ``recv`` in); returns the receive
    buffer, not to be read before :class:`_Wait`. Backward: wait for the gradient's exchange
    that the matching :class:`_Wait`'s backward started (the gradient handed in is the one
    already on its way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, box: "_Pending") -> torch.Tensor:
        ctx.box = box
        return box.start(x, box.send, box.recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.box.wait(), None


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange :class:`_Start` began. Backward: start the gradient's
    exchange back (receive and send counts swapped) and return at once; :class:`_Start`'s
    backward, run by autograd after what else is ready, waits for it."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, box: "_Pending") -> torch.Tensor:
        ctx.box = box
        return box.wait().view_as(buf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box = ctx.box
        box.start(grad, box.recv, box.send)
        return grad, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows out by ``send`` counts, in by ``recv`` counts, waited at once (differentiable)."""
    box = _Pending(send, recv, group)
    return _Wait.apply(_Start.apply(x, box), box)


def _bounds(rt: EPRuntime, tokens: int, rank: int | None = None) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``tokens`` that tensor rank ``rank`` (default this one) computes when
    a dropless layer is folded over the tensor axis (near-equal consecutive shares)."""
    r = rt.fold_rank if rank is None else rank
    return tokens * r // rt.fold, tokens * (r + 1) // rt.fold


def _share(x: torch.Tensor, rt: EPRuntime) -> torch.Tensor:
    lo, hi = _bounds(rt, x.shape[0])
    return x[lo:hi]


def _gather_rows(part: torch.Tensor, rt: EPRuntime, tokens: int) -> torch.Tensor:
    """Every tensor rank's share of ``tokens`` rows, in order (each padded to the largest share
    for one all-gather)."""
    most = -(-tokens // rt.fold)
    padded = part.new_zeros((most, *part.shape[1:]))
    padded[:part.shape[0]] = part
    parts = [torch.empty_like(padded) for _ in range(rt.fold)]
    dist.all_gather(parts, padded.contiguous(), group=lane_group(rt.fold_group))
    return torch.cat([q[:hi - lo] for q, (lo, hi) in zip(parts, (_bounds(rt, tokens, r) for r in range(rt.fold)))])


class _TokenShare(torch.autograd.Function):
    """Forward: this tensor rank's share of rows every tensor rank holds alike. Backward: the
    whole gradient, each rank's share gathered (every rank then holds it alike, as the rows were)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rt: EPRuntime) -> torch.Tensor:
        ctx.rt, ctx.tokens = rt, x.shape[0]
        return _share(x, rt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_rows(grad, ctx.rt, ctx.tokens), None


class _TokenGather(torch.autograd.Function):
    """Forward: the whole rows from every tensor rank's share. Backward: this rank's share of the
    gradient (which every tensor rank holds alike)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, rt: EPRuntime, tokens: int) -> torch.Tensor:
        ctx.rt = rt
        return _gather_rows(part, rt, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _share(grad, ctx.rt), None, None


_LAYERS: dict[int, "DroplessMoE"] = {}


@dataclass
class DroplessMoE:
    """One dropless MoE layer on the expert axis ``rt``.

    ``expert(slot, rows, params)`` runs this rank's ``slot``-th expert (``rt.owned()[slot]``)
    on ``rows`` with this rank's expert parameters ``params`` (the graph's order); it must
    give a gradient (zeros) to its parameters even for zero rows. ``out_dtype``: the dtype
    of the layer's output in the single-device graph.

    ``chunks``: the tokens go in this many consecutive chunks, each with its own exchanges, so
    that one chunk's all-to-all travels while another chunk's experts compute: every chunk's
    rows are sent first, then each chunk's experts run as soon as its rows are in and its
    outputs start back at once. Backward overlaps alike (autograd runs the later chunk's nodes
    first: its gradients' exchange is started while the other chunk's experts run backward).
    Each row meets the same expert whatever its chunk, so the result is the one-chunk result."""

    rt: EPRuntime
    expert: Callable[[int, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
    out_dtype: torch.dtype
    chunks: int | None = None        # None: the axis's (EPRuntime.chunks)
    id: int = -1

    def __post_init__(self) -> None:
        if self.chunks is None:
            self.chunks = self.rt.chunks
        self.id = next(_IDS)
        _LAYERS[self.id] = self
        pos = [0] * self.rt.experts
        for i, e in enumerate(self.rt.perm):
            pos[e] = i
        self._pos = torch.tensor(pos)                  # expert id -> place in owner order

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 params: Sequence[torch.Tensor]) -> torch.Tensor:
        rt = self.rt
        flat_x = x.reshape(-1, x.shape[-1])
        tokens = flat_x.shape[0]
        ids2, w2 = ids.reshape(tokens, -1), weights.reshape(tokens, -1)
        if rt.fold > 1:          # rows replicated over the tensor axis: this rank computes its share
            y = _TokenGather.apply(self._layer(_TokenShare.apply(flat_x, rt), _share(ids2, rt),
                                               _TokenShare.apply(w2, rt), params), rt, tokens)
        else:
            y = self._layer(flat_x, ids2, w2, params)
        return y.to(self.out_dtype).reshape(*x.shape[:-1], y.shape[-1])

    def _layer(self, flat_x: torch.Tensor, ids2: torch.Tensor, w2: torch.Tensor,
               params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The layer's output rows ``[tokens, h]`` for rows ``flat_x`` and their routing top-k."""
        rt = self.rt
        per, n = rt.experts // rt.n, rt.n
        tokens, k = flat_x.shape[0], ids2.shape[1]
        if self._pos.device != ids2.device:
            self._pos = self._pos.to(ids2.device)
        chunks = max(1, min(self.chunks, tokens))
        bounds = [(tokens * c // chunks, tokens * (c + 1) // chunks) for c in range(chunks)]
        if rt.node_ranks > 1 and rt.n > rt.node_ranks:
            return self._two_hop(flat_x, ids2, w2, params, bounds)
        orders, counts = [], []
        for a, b in bounds:
            pos = self._pos[ids2[a:b].reshape(-1)]                     # pair (t, j) -> owner-order place
            orders.append(torch.sort(pos, stable=True).indices)        # by owner rank, then by its expert
            counts.append(torch.bincount(pos, minlength=rt.experts))
        # rows per (destination rank, chunk, its expert): one exchange of counts for the layer
        send_t = torch.stack(counts).view(chunks, n, per).transpose(0, 1).contiguous()
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=lane_group(rt.group))
        send_l, recv_l = send_t.sum(-1).tolist(), recv_t.sum(-1).tolist()      # [rank][chunk]
        slot_ids = torch.arange(per, device=ids2.device).repeat(n)
        boxes, bufs = [], []
        for c, (a, b) in enumerate(bounds):
            box = _Pending([s[c] for s in send_l], [r[c] for r in recv_l], rt.group)
            bufs.append(_Start.apply(flat_x[a:b][orders[c] // k], box))
            boxes.append(box)
        back = []
        for c in range(chunks):
            rows = _Wait.apply(bufs[c], boxes[c])                      # by source rank, then by expert slot
            slots = torch.repeat_interleave(slot_ids, recv_t[:, c, :].reshape(-1))
            box = _Pending(boxes[c].recv, boxes[c].send, rt.group)
            back.append((_Start.apply(self._run_experts(rows, slots, per, params), box), box))
        ys = []
        for c, (a, b) in enumerate(bounds):
            out = _Wait.apply(*back[c])
            pair_out = out[torch.argsort(orders[c])]                   # back to (t, j) order
            ys.append((pair_out.view(b - a, k, -1) * w2[a:b].unsqueeze(-1)).sum(dim=1))
        return ys[0] if chunks == 1 else torch.cat(ys)

    def _two_hop(self, flat_x: torch.Tensor, ids2: torch.Tensor, w2: torch.Tensor, params: Sequence[torch.Tensor],
                 bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The exchange in two hops (module docstring of :class:`DroplessMoE`, ``node_ranks``):
        a token crosses to each node holding one of its experts once, to the rank at this rank's
        place there (the *relay*, over ``rail``); the relay hands it to the experts' owners on its
        node (over ``intra``), sums their outputs weighted by the routing weights, and sends one
        row per token back. The rows' exchanges over ``rail`` overlap the chunks as in one hop."""
        rt = self.rt
        g, k, per = rt.node_ranks, ids2.shape[1], rt.experts // rt.n
        m = rt.n // g
        sent, started = [], []
        for a, b in bounds:
            tc = b - a
            pos = self._pos[ids2[a:b]]                                 # [tc, k] owner-order places
            node = pos // (per * g)
            key = (node * tc + torch.arange(tc, device=pos.device).unsqueeze(1)).reshape(-1)
            rows_key, row_of_pair = torch.unique(key, sorted=True, return_inverse=True)   # by node, then token
            token = rows_key % tc
            nrows = rows_key.numel()
            slot = torch.arange(k, device=pos.device).repeat(tc)
            meta_pos = pos.new_full((nrows, k), -1).index_put((row_of_pair, slot), pos.reshape(-1))
            meta_w = w2.new_zeros((nrows, k)).index_put((row_of_pair, slot), w2[a:b].reshape(-1))
            send = torch.bincount(rows_key // tc, minlength=m)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=lane_group(rt.rail))
            send_l, recv_l = send.tolist(), recv.tolist()
            box = _Pending(send_l, recv_l, rt.rail)
            got_pos = pos.new_empty((sum(recv_l), k))
            dist.all_to_all_single(got_pos, meta_pos, recv_l, send_l, group=lane_group(rt.rail))
            got_w = _exchange(meta_w, send_l, recv_l, rt.rail)
            started.append((_Start.apply(flat_x[a:b][token], box), box, got_pos, got_w))
            sent.append((token, tc))
        back = []
        for buf, box, got_pos, got_w in started:
            rows = _Wait.apply(buf, box)                               # [R, h] from every node, for this node
            partial = self._on_node(rows, got_pos, got_w, params, per, g)
            out_box = _Pending(box.recv, box.send, rt.rail)
            back.append((_Start.apply(partial, out_box), out_box))
        ys = []
        for (token, tc), (buf, box) in zip(sent, back):
            partial = _Wait.apply(buf, box)                            # one row per (token, node)
            ys.append(partial.new_zeros((tc, partial.shape[-1])).index_add(0, token, partial))
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def _on_node(self, rows: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, params: Sequence[torch.Tensor],
                 per: int, g: int) -> torch.Tensor:
        """The relay's part: each received row's pairs on this node to their owners and back,
        summed with their weights into one row per received row."""
        rt = self.rt
        r, j = (pos >= 0).nonzero(as_tuple=True)
        ppos = pos[r, j]
        order = torch.sort(ppos, stable=True).indices                  # by owner on the node, then its expert
        r, j, ppos = r[order], j[order], ppos[order]
        local = ppos % (per * g)                                       # place among this node's experts
        send_t = torch.bincount(local, minlength=per * g).view(g, per)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=lane_group(rt.intra))
        send_l, recv_l = send_t.sum(-1).tolist(), recv_t.sum(-1).tolist()
        got = _exchange(rows[r], send_l, recv_l, rt.intra)             # by source relay, then expert slot
        slots = torch.repeat_interleave(torch.arange(per, device=pos.device).repeat(g), recv_t.reshape(-1))
        out = _exchange(self._run_experts(got, slots, per, params), recv_l, send_l, rt.intra)
        contrib = out * w[r, j].unsqueeze(-1)
        return contrib.new_zeros((rows.shape[0], contrib.shape[-1])).index_add(0, r, contrib)

    def _run_experts(self, rows: torch.Tensor, slots: torch.Tensor, per: int,
                     params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each local expert on the rows it received (from every rank), in the received order."""
        order = torch.sort(slots, stable=True).indices
        counts = torch.bincount(slots, minlength=per).tolist()
        grouped = rows[order].split(counts)
        outs = [self.expert(j, grouped[j], params) for j in range(per)]
        return torch.cat(outs)[torch.argsort(order)]


def autopar_ep_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, params: Sequence[torch.Tensor],
                   lid: int) -> torch.Tensor:
    """A dropless MoE layer's experts on the expert axis (graph node; see :class:`DroplessMoE`):
    ``x`` the tokens ``[..., h]``, ``ids``/``weights`` the routing top-k ``[..., k]``."""
    return _LAYERS[lid](x, ids, weights, params)


EP_OPS = (autopar_ep_dispatch, autopar_ep_combine, autopar_ep_moe)


def average_over_senders(params: Sequence[torch.Tensor], n: int) -> None:
    """Divide the gradients of expert parameters by the expert axis's size ``n`` as they arrive,
    for experts that have no data axis (with one, it divides by ``dp x ep`` instead).

    An expert's owner computes its gradient on the rows every rank of the expert axis sent it,
    and each rank's loss is a mean over its own rows, so the owner receives the sum of ``n``
    ranks' mean-loss gradients; the whole batch's mean loss wants their mean. (The dense
    parameters get the same mean by averaging over the expert axis as over a data axis.)"""
    for p in params:
        if p.requires_grad and not getattr(p, "_autopar_ep_scaled", False):
            p.register_hook(lambda g, n=n: g / n if g is not None else g)
            p._autopar_ep_scaled = True

__all__ = ["EPRuntime", "DroplessMoE", "autopar_ep_dispatch", "autopar_ep_combine", "autopar_ep_moe", "EP_OPS",
           "average_over_senders"]


def whole_experts(local: torch.Tensor, rt: "EPRuntime") -> torch.Tensor:
    """The whole stacked expert tensor ``[E, ...]`` from each ep rank's owned rows (``local``:
    this rank's, in its owned order); every rank of the ep group must call it."""
    if rt.n == 1 or rt.group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(rt.n)]
    dist.all_gather(parts, local.contiguous(), group=rt.group)
    whole = local.new_empty((rt.experts, *local.shape[1:]))
    for r, part in enumerate(parts):
        whole[torch.tensor(rt.owned(r), device=local.device)] = part
    return whole


def owned_rows(whole: torch.Tensor, rt: "EPRuntime") -> torch.Tensor:
    """This rank's owned expert rows of a whole ``[E, ...]`` tensor (what it holds)."""
    return whole.index_select(0, torch.tensor(rt.owned(), device=whole.device)).clone()

