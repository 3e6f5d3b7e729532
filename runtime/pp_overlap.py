"""DualPipeV's overlapped pairs, run at once: one micro-batch's forward beside another's backward.

torch's ``ScheduleDualPipeV`` pairs, in its steady state, the forward of one stage and
micro-batch with the backward of the other stage of the same rank and another micro-batch (an
``OVERLAP_F_B`` action), and by default runs the two one after the other. :class:`PairRunner`
(registered for that action) runs the forward on a worker thread while the calling thread runs
the backward, so that the exchanges of one (the expert all-to-alls of a mixture-of-experts
layer) travel while the other computes: the overlap DeepSeek-V3's DualPipe makes.

Each half does what torch's schedule does for the action alone: the forward waits for its
received input, runs, computes the loss on the last stage and hands its output to the next stage
when that stage is on this rank (the V's turn); the backward likewise. The two halves touch
different stages and micro-batches. What they share:

- **Collectives.** Two threads issuing collectives on one process group would interleave them
  in an order that differs between ranks. Collectives a forward issues on the worker thread go
  to a second group over the same ranks (:func:`lane_group`); each group then sees one thread's
  sequence, the same on every rank of it (the ranks of a group run the same schedule).
  The build refuses the schedule where a stage issues collectives this does not cover
  (autopar/build/pipeline.py: tensor and context axes, ZeRO-3 gathers).
- **Random numbers.** One generator, drawn from by both threads in an order that varies
  between runs: the build refuses random ops under this schedule.

- **CUDA streams.** On a GPU the forward half runs on a stream of its own (it starts after what
  the calling thread's stream holds, and that stream waits for it when the pair ends), so the
  backward's kernels do not queue behind the forward's waits for its exchanges. (Not yet run on
  a GPU: the tests run on CPU, where each thread's ops run as they are called.)

The worker's result (or exception) is collected before the action ends, so the next action, and
its sends, see both halves done.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

_LANE = threading.local()
_SECOND: dict[int, Any] = {}     # id(group) -> the same ranks' second group (made by every rank, in order)
SECOND_LANE_CALLS = [0]          # collectives sent to a second group (read by the tests)


def in_forward_lane() -> bool:
    """Is this thread the pairs' forward worker?"""
    return getattr(_LANE, "forward", False)


def pair_lanes(pairs: list[tuple[Any, Any]]) -> None:
    """Record, for each (group, second group over the same ranks), the group a paired forward's
    collectives use instead (both made by the build on every rank, in one order)."""
    for group, second in pairs:
        if group is not None:
            _SECOND[id(group)] = second


def lane_group(group: Any) -> Any:
    """``group``, or its second group when called from the forward worker (see the module notes)."""
    if group is not None and in_forward_lane():
        second = _SECOND.get(id(group))
        if second is None:
            raise RuntimeError("a collective on a process group without a second lane ran in an overlapped forward")
        SECOND_LANE_CALLS[0] += 1
        return second
    return group


def _forward_worker() -> None:
    _LANE.forward = True


class PairRunner:
    """The ``OVERLAP_F_B`` action of torch's pipeline runtime (see the module notes).
    ``events``, when a list, records ``("start"/"end", "F"/"B", stage, micro-batch, thread name,
    perf_counter())`` in the order the halves reach them (read by the tests)."""

    record: list | None = None        # when a list: every runner's events go there too (tests)

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-pp-forward",
                                        initializer=_forward_worker)
        self.events: list | None = PairRunner.record
        self.pairs = 0
        self._side: dict[Any, Any] = {}     # CUDA device -> the forward half's stream

    @classmethod
    def register(cls, schedule: Any) -> "PairRunner":
        """A runner for ``schedule``'s (a ``ScheduleDualPipeV``'s) overlapped pairs, registered."""
        from torch.distributed.pipelining.schedules import _ComputationType
        runner = cls()
        schedule.register_custom_function(_ComputationType.OVERLAP_F_B, runner)
        return runner

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __call__(self, action: Any, ctx: Any) -> None:
        sched = ctx.schedule_ref
        f, b = action.sub_actions
        stages = {st.stage_index: st for st in sched._stages}
        self.pairs += 1
        side = self._side_stream(stages[f.stage_index].device)
        pending = self._pool.submit(self._forward, sched, stages, f, ctx, side)
        try:
            self._backward(sched, stages, b)
        finally:
            pending.result()           # the forward's exception, if it raised, surfaces here
            if side is not None:       # what follows on this stream sees the forward's work done
                torch.cuda.current_stream(side.device).wait_stream(side)

    def _side_stream(self, device: Any) -> Any:
        """On a CUDA device, the forward half's own stream, set to start after what the calling
        thread's stream has queued: one stream for both halves would queue the backward's kernels
        behind the forward's waits for its exchanges. None elsewhere."""
        if getattr(device, "type", None) != "cuda":
            return None
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        return side

    def _note(self, *event: Any) -> None:
        if self.events is not None:
            self.events.append((*event, threading.current_thread().name, time.perf_counter()))

    def _forward(self, sched: Any, stages: dict, a: Any, ctx: Any, side: Any = None) -> None:
        if side is None:
            return self._forward_here(sched, stages, a, ctx)
        with torch.cuda.stream(side):
            return self._forward_here(sched, stages, a, ctx)

    def _forward_here(self, sched: Any, stages: dict, a: Any, ctx: Any) -> None:
        stage, mb = stages[a.stage_index], a.microbatch_index
        self._note("start", "F", a.stage_index, mb)
        if not stage.is_first and a.stage_index - 1 not in stages:
            wait_recv(sched, "F", a.stage_index, mb)
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        sched._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if a.stage_index + 1 in stages:
            stages[a.stage_index + 1].set_local_fwd_input(output, mb)
        self._note("end", "F", a.stage_index, mb)

    def _backward(self, sched: Any, stages: dict, a: Any) -> None:
        stage, mb = stages[a.stage_index], a.microbatch_index
        self._note("start", "B", a.stage_index, mb)
        if not stage.is_last and a.stage_index + 1 not in stages:
            wait_recv(sched, "B", a.stage_index, mb)
        loss = sched._maybe_get_loss(stage, mb)
        sched.backward_counter[a.stage_index] += 1
        last = sched.backward_counter[a.stage_index] == sched._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if a.stage_index - 1 in stages:
            stages[a.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
        self._note("end", "B", a.stage_index, mb)


def wait_recv(sched: Any, kind: str, stage_index: int, mb: int) -> None:
    """Wait for the receive the schedule posted for (stage, micro-batch): its input (``F``) or
    its output's gradient (``B``)."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p
    ops = sched.fwd_recv_ops if kind == "F" else sched.bwd_recv_ops
    key = (stage_index, mb)
    if key not in ops:
        raise RuntimeError(f"pipeline: {kind} of stage {stage_index}, micro-batch {mb}, before its receive was posted")
    _wait_batch_p2p(ops.pop(key))


__all__ = ["PairRunner", "in_forward_lane", "lane_group", "pair_lanes", "wait_recv"]
