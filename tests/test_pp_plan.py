"""Pipeline cut planning and the stage split, in one process.

- Chained stage modules compute the model's output and gradients at any valid cuts
  (hypothesis picks the cut positions), and keep the original parameter names.
- A model with a heavy last stage (a large vocabulary head) gets non-uniform cuts whose
  simulated step time beats the equal-layer cuts.
- Cuts sit where little crosses, respect a memory budget, and a budget nothing fits says so.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar import models
from autopar.build.prepare import capture_model
from autopar.cost.cluster import Cluster
from autopar.core.errors import ConfigError
from autopar.passes.pp_split import layer_cuts, op_costs, plan_cuts, shared_params, split_stages
from autopar.cost.pp_planner import node_time_fn, simulate_plan
from autopar.runtime.pp import StageModule, stage_inputs_of

SMALL = {"gpt": {"layers": 3, "hidden": 32, "heads": 4, "vocab": 64, "max_seq": 16},
         "llama": {"layers": 3, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "max_seq": 16}}


def _graph(name: str, overrides: dict, batch: int, seq: int, device: str = "cpu"):
    torch.manual_seed(0)
    model = models.build(name, overrides, device=device)
    args, _ = models.example_inputs(model, batch, seq, device=device)
    return model, args, capture_model(model, args, ())


def _chain(model, gm, starts, args):
    stages = split_stages(gm, starts)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    trainable = {k: p.requires_grad for k, p in model.named_parameters()}
    made, mods = {}, []
    for sg in stages:
        m = StageModule(sg, tensors, trainable, {}, 0, 1, input_names=stage_inputs_of(gm) if sg.index == 0 else (),
                        shared=made)
        made.update(dict(m.named_parameters(remove_duplicate=False)))
        mods.append(m)
    out = args
    for m in mods:
        out = m(*out)
        out = out if isinstance(out, tuple) else (out,)
    return stages, mods, out[0]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["gpt", "llama"]), nstages=st.integers(2, 4), data=st.data())
def test_chained_stages_compute_the_model_at_any_valid_cuts(name, nstages, data):
    model, args, gm = _graph(name, SMALL[name], 2, 8)
    costs = op_costs(gm, node_time=lambda n: 1.0)
    valid = [j for j in range(1, len(costs.ops)) if costs.valid[j]]
    cuts = sorted(data.draw(st.lists(st.sampled_from(valid), min_size=nstages - 1, max_size=nstages - 1,
                                     unique=True)))
    stages, mods, out = _chain(model, gm, [0] + cuts, args)
    want = model(*args)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # gradients: each stage's parameters; a parameter held twice (tied) sums its copies' grads
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    names = set()
    for m in mods:
        names |= {k for k, _ in m.named_parameters(remove_duplicate=False)}
    assert names == {k for k, _ in model.named_parameters()}          # names survive the split
    ref = dict(model.named_parameters())
    seen = set()
    for m in mods:
        for k, p in m.named_parameters(remove_duplicate=False):
            if k in seen or not ref[k].requires_grad:
                continue
            seen.add(k)
            torch.testing.assert_close(p.grad, ref[k].grad, rtol=1e-5, atol=1e-6)


def test_gpt_tied_embedding_is_shared_by_first_and_last_stage():
    model, args, gm = _graph("gpt", SMALL["gpt"], 2, 8)
    costs = op_costs(gm, node_time=lambda n: 1.0)
    stages = split_stages(gm, plan_cuts(costs, 3).starts)
    assert shared_params(stages) == {"wte.weight": [0, 2]}


def _heavy_head():
    # a vocabulary of 32k on a 64-wide, 4-layer model: the head is most of the work
    over = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 32768, "max_seq": 64}
    return _graph("llama", over, 4, 64, device="meta")


def test_heavy_head_gets_uneven_cuts_that_beat_equal_layers():
    _, _, gm = _heavy_head()
    cluster = Cluster.from_spec("1x2", hardware="a100")
    costs = op_costs(gm, node_time=node_time_fn(cluster.device, "fp32"))
    best = plan_cuts(costs, 2)
    naive = layer_cuts(costs, 2)
    assert best.starts != naive.starts
    kw = dict(schedule="1f1b", devices=2, virtual=1, microbatches=8, p2p_time=lambda b: 0.0)
    t_best = simulate_plan(costs, best, **kw).step_time_s
    t_naive = simulate_plan(costs, naive, **kw).step_time_s
    assert t_best < t_naive
    # the balance is what the DP optimises: the bottleneck stage is lighter than naive's
    assert max(best.stage_time_s) < max(naive.stage_time_s)
    # and the last stage (the head) holds fewer layers than the first
    blocks = [sum(1 for n in costs.ops[a:b] if n.meta.get("autopar") and n.meta["autopar"].block_member)
              for a, b in zip(best.starts, list(best.starts[1:]) + [len(costs.ops)])]
    assert blocks[-1] < blocks[0]


def test_cuts_prefer_small_crossings_and_respect_the_budget():
    _, _, gm = _graph("gpt", {**SMALL["gpt"], "layers": 4}, 2, 8)
    costs = op_costs(gm, node_time=lambda n: 1.0)
    free = plan_cuts(costs, 2)
    least = min(costs.crossing_bytes[j] for j in range(1, len(costs.ops)) if costs.valid[j])
    assert free.crossing_bytes[0] <= 2 * least
    # with time no object (every op costs the same), a budget tight on one side moves the cut
    state = sum(costs.param_bytes) + sum(costs.saved_bytes)
    heavy_first = [1.0 + (5.0 if j < len(costs.ops) // 4 else 0.0) for j in range(len(costs.ops))]
    costs.time_s[:] = heavy_first              # the time balance wants a short first stage ...
    budget = 0.55 * state
    bounded = plan_cuts(costs, 2, budget=budget)
    assert all(s + a <= budget for s, a in zip(bounded.stage_state_bytes, bounded.stage_saved_bytes))
    unbounded = plan_cuts(costs, 2)
    assert max(s + a for s, a in zip(unbounded.stage_state_bytes, unbounded.stage_saved_bytes)) > budget
    assert bounded.starts[1] > unbounded.starts[1]   # ... the budget pushes the cut later
    with pytest.raises(ConfigError, match="fits the memory budget"):
        plan_cuts(costs, 2, budget=0.1 * state)


def test_too_many_stages_is_a_clear_error():
    _, _, gm = _graph("gpt", {**SMALL["gpt"], "layers": 1}, 2, 8)
    costs = op_costs(gm, node_time=lambda n: 1.0)
    with pytest.raises(ConfigError, match="cannot be cut"):
        plan_cuts(costs, len(costs.ops) + 5)
