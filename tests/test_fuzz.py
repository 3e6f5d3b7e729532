"""Fuzz: whatever the model, mesh and constraints, autopar either trains a parallel model
that computes what the single-process model computes, or refuses with an AutoparError -
never another exception, a hang, or a wrong answer.

Each example draws a small model (the zoo's ``mlp`` and ``gpt``, a stack of Linear layers
with random widths, many not divisible by the tensor axis, optionally with a LayerNorm, in
fp32 or fp64, or a tiny ``transformers`` Llama, GPT-2, Qwen2 or Gemma 2 in fp32 or fp64), a
mesh (tp=2, dp=2, dp=2 x tp=2, tp=4), a per-rank batch, and constraints: a ZeRO stage, a
memory budget ("as lean as possible" or a tight one), and a forced placement of one
parameter (divisible or not; a split the mesh cannot make must be a ShardingError, or a
MeshError without a tensor axis). It is planned in the test process (``autopar.plan``); a plan
is then applied on real gloo ranks, trained for two SGD steps beside a single-process copy
on the whole batch (each rank's share in turn, losses averaged as the data axis averages
gradients), and every rank's losses and whole parameters must match within 1e-4 relative.
"""
from __future__ import annotations

import copy
import traceback

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import nn

import autopar
from autopar import AutoparError, MeshError, ShardingError, models
from autopar.runtime.launch import run_ranks

STEPS = 2
RTOL = 1e-4
MESHES = ({"tp": 2}, {"dp": 2}, {"dp": 2, "tp": 2}, {"tp": 4})


class Stack(nn.Module):
    """Linear layers of the given widths with ReLU between, optionally a LayerNorm after the first."""

    def __init__(self, widths: tuple[int, ...], norm: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.norm = nn.LayerNorm(widths[1]) if norm else None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.norm is not None:
                x = self.norm(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _build(case: dict) -> nn.Module:
    torch.manual_seed(0)
    if case["kind"] == "hf":
        import hf_tiny
        return hf_tiny.build(case["arch"], getattr(torch, case["dtype"]))
    if case["kind"] == "stack":
        return Stack(case["widths"], case["norm"]).to(getattr(torch, case.get("dtype", "float32")))
    return models.build(case["kind"], case["config"], device="cpu")


def _inputs(case: dict, batch: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    if case["kind"] == "stack":
        return (torch.randn(batch, case["widths"][0], dtype=getattr(torch, case.get("dtype", "float32"))),)
    if case["kind"] == "mlp":
        return (torch.randn(batch, case["config"]["width"]),)
    if case["kind"] == "hf":
        return (torch.randint(3, 64, (batch, case["seq"])),)
    return (torch.randint(0, case["config"]["vocab"], (batch, case["seq"])),)


def _loss(case: dict, out: torch.Tensor) -> torch.Tensor:
    if case["kind"] == "hf":
        out = out.logits
    if case["kind"] not in ("gpt", "hf"):
        return out.pow(2).mean()
    target = torch.arange(out[..., 0].numel()).remainder(out.shape[-1]).view(out.shape[:-1])
    return nn.functional.cross_entropy(out.flatten(0, -2), target.flatten())


def _budget(case: dict, model: nn.Module) -> float | None:
    state = 16 * sum(p.numel() for p in model.parameters())
    return {"none": None, "lean": 1.0, "tight": 0.4 * state}[case["budget"]]


def _forced(case: dict, model: nn.Module) -> dict[str, str] | None:
    if case["force"] is None:
        return None
    index, placement = case["force"]
    names = [k for k, _ in model.named_parameters()]
    return {names[index % len(names)]: placement}


def _refusal(case: dict, model: nn.Module) -> type | None:
    """The error a forced split must raise: no tensor axis, no such dim, or a dim it does not divide."""
    forced = _forced(case, model)
    if not forced:
        return None
    (fqn, placement), = forced.items()
    if placement == "R":
        return None
    tp, dim, shape = case["mesh"].get("tp", 1), int(placement[2:-1]), dict(model.named_parameters())[fqn].shape
    if tp == 1:
        return MeshError
    return ShardingError if dim >= len(shape) or shape[dim] % tp else None


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item() / max(scale, 1e-6)


def _train_rank(rank: int, world: int, case: dict, plan) -> tuple:
    """One rank: the parallel model and the single-process copy, two SGD steps each."""
    try:
        model = _build(case)
        ref = copy.deepcopy(model)
        dp, tp = plan.dp, plan.tp
        args = _inputs(case, case["per_rank"] * dp)
        shares = [tuple(a.chunk(dp)[k] for a in args) for k in range(dp)]
        local = shares[rank // tp]
        pm = autopar.parallelize(model, plan.mesh, local, plan=plan)
        opt = autopar.optimizer(pm, torch.optim.SGD, lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        worst = 0.0
        for _ in range(STEPS):
            loss = _loss(case, pm(*local))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses = [_loss(case, ref(*share)) for share in shares]
            (sum(ref_losses) / dp).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            want = ref_losses[rank // tp]
            worst = max(worst, _rel(loss, want, want.abs().item()))
        whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in pm.state_dict().items()}
        ref_sd = ref.state_dict()
        scale = max(v.abs().max().item() for v in ref_sd.values())
        params = max(_rel(whole[k], ref_sd[k], scale) for k in ref_sd)
        return "ok", {"loss": worst, "params": params}, sorted(whole) == sorted(ref_sd)
    except Exception as exc:  # noqa: BLE001 - the test classifies every failure
        return "error", type(exc).__name__, isinstance(exc, AutoparError), traceback.format_exc()


@st.composite
def cases(draw) -> dict:
    kind = draw(st.sampled_from(["stack", "mlp", "gpt", "hf"]))
    case: dict = {"kind": kind, "mesh": draw(st.sampled_from(MESHES)), "per_rank": draw(st.integers(1, 3)),
                  "zero": draw(st.sampled_from([None, 0, 1, 2, 3])),
                  "budget": draw(st.sampled_from(["none", "lean", "tight"])),
                  "force": draw(st.none() | st.tuples(st.integers(0, 50), st.sampled_from(["R", "S(0)", "S(1)"])))}
    if kind == "stack":
        case["widths"] = tuple(draw(st.lists(st.sampled_from([2, 3, 4, 6, 8, 12]), min_size=2, max_size=4)))
        case["norm"] = draw(st.booleans())
        case["dtype"] = draw(st.sampled_from(["float32", "float64"]))
    elif kind == "mlp":
        case["config"] = {"width": draw(st.sampled_from([6, 8, 12])), "depth": draw(st.integers(1, 2))}
    else:
        heads = draw(st.sampled_from([2, 4]))
        case["config"] = {"layers": 1, "heads": heads, "hidden": heads * draw(st.sampled_from([2, 3])),
                          "vocab": draw(st.sampled_from([30, 32])), "max_seq": 8}
        case["seq"] = draw(st.sampled_from([4, 6]))
    if kind == "hf":            # an unmodified transformers model, called on token ids
        case["arch"] = draw(st.sampled_from(["llama", "gpt2", "qwen2", "gemma2"]))
        case["dtype"] = draw(st.sampled_from(["float32", "float64"]))
        case["seq"] = draw(st.sampled_from([4, 6]))
    return case


_HIDDEN6_TP4 = {"kind": "stack", "widths": (8, 6, 8), "norm": False, "mesh": {"tp": 4}, "per_rank": 2,
                "zero": None, "budget": "lean", "force": None}


@settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(case=_HIDDEN6_TP4)
@example(case={**_HIDDEN6_TP4, "force": (0, "S(0)")})     # forced split of the 6-wide dim: a ShardingError
@example(case={**_HIDDEN6_TP4, "mesh": {"dp": 2, "tp": 2}, "zero": 3, "force": (0, "S(0)")})
@given(case=cases())
def test_parallel_model_is_correct_or_refused_with_an_autopar_error(case):
    model = _build(case)
    dp = case["mesh"].get("dp", 1)
    local = tuple(a.chunk(dp)[0] for a in _inputs(case, case["per_rank"] * dp))
    options = dict(zero_stage=case["zero"], memory_budget=_budget(case, model), placements=_forced(case, model))
    refusal = _refusal(case, model)
    if refusal is not None:
        with pytest.raises(refusal):
            autopar.plan(model, case["mesh"], local, **options)
        return
    try:
        plan = autopar.plan(model, case["mesh"], local, **options)
    except AutoparError:
        return                  # a clear refusal (DoesNotFitError, ...) is an allowed outcome
    world = 1
    for size in case["mesh"].values():
        world *= size
    results = run_ranks(_train_rank, world, case, plan, timeout_s=120)
    for rank, res in enumerate(results):
        if res[0] == "error":
            _, name, is_ours, tb = res
            assert is_ours, f"rank {rank} raised {name}, not an AutoparError, for {case}:\n{tb}"
            continue
        _, err, keys_match = res
        assert keys_match, f"rank {rank}: state_dict keys differ from the model's for {case}"
        assert err["loss"] <= RTOL and err["params"] <= RTOL, f"rank {rank}: {err} for {case} (plan {plan.params})"
    assert len({r[0] for r in results}) == 1, f"ranks disagree: {[r[:2] for r in results]} for {case}"


# ---- bad inputs: plan files and command lines --------------------------------------------------
# Every outcome is a result or a typed error (a PlanFileError; exit status 0 or 2 from the CLI),
# never another exception. The command lines run in this process (autopar.cli.main), on tiny
# models and clusters, so each example costs well under a second.

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402

from autopar.cli import main as cli_main  # noqa: E402
from autopar.core.saved_plan import SavedPlan  # noqa: E402
from autopar.core.errors import PlanFileError  # noqa: E402
from autopar.core.plans import Plan  # noqa: E402

_JSON_LEAVES = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 2, 3, -1, 2**31])
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
                | st.sampled_from(["R", "S(0)", "tp", "dp", "1f1b", "bf16"]))
_JSON = st.recursive(_JSON_LEAVES, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _valid_plans() -> tuple[dict, dict]:
    plan = json.loads(Plan(mesh={"dp": 2, "tp": 2}, tp_axis="tp", dp_axis="dp", params={"w": "S(0)", "b": "R"},
                           nodes={"mm": {"name": "colwise", "inputs": ["R/gP"], "outputs": ["S(1)/gS(1)"]}},
                           zero_stage=1, shapes={"w": [4, 4], "b": [4]}, model="m").to_json())
    saved = {"format": "autopar plan", "version": 1, "model": "gpt", "overrides": {"layers": "2"}, "cluster": "1x8",
             "hardware": "h100", "devices": 8, "batch": 16, "seq": 128, "dtype": "bf16",
             "config": {"dp": 2, "tp": 2, "pp": 2, "micro_batch": 2, "schedule": "1f1b", "virtual": 1,
                        "recompute": "none", "zero_stage": 1, "ep": 1},
             "microbatches": 4, "predicted": {"step_time_s": 1.0, "mfu": 0.4}}
    return plan, saved


@st.composite
def plan_file_texts(draw) -> tuple[str, str | bytes]:
    """A valid plan file (of either kind), with one to three mutations: a field (at any depth)
    set to any JSON value or removed, an unknown field added, or the text cut, spliced or
    made invalid UTF-8."""
    kind = draw(st.sampled_from(["plan", "saved"]))
    data = _valid_plans()[kind == "saved"]
    for _ in range(draw(st.integers(1, 3))):
        target, path = data, []
        while isinstance(target, dict) and target and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(target)))
            if not isinstance(target[key], dict):
                break
            target, path = target[key], path + [key]
        if not isinstance(target, dict):
            continue
        op = draw(st.sampled_from(["set", "set", "drop", "add"]))
        if op == "add" or not target:
            target[draw(st.text(min_size=1, max_size=8))] = draw(_JSON)
        elif op == "set":
            target[draw(st.sampled_from(sorted(target)))] = draw(_JSON)
        else:
            target.pop(draw(st.sampled_from(sorted(target))))
    text = json.dumps(data)
    raw = draw(st.sampled_from(["as is", "as is", "cut", "splice", "bytes", "deep"]))
    if raw == "cut":
        return kind, text[:draw(st.integers(0, len(text)))]
    if raw == "splice":
        at = draw(st.integers(0, len(text)))
        return kind, text[:at] + draw(st.sampled_from(["Infinity", "NaN", "1e999", "9" * 5000, "[" * 3000, '"\\ud800"',
                                                       "}", ","])) + text[at:]
    if raw == "bytes":
        at = draw(st.integers(0, len(text)))
        return kind, text[:at].encode() + draw(st.binary(min_size=1, max_size=4)) + text[at:].encode()
    if raw == "deep":
        return kind, text[:-1] + ', "predicted": ' + "[" * 50 + "]" * 50 + "}"
    return kind, text


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_file_texts())
def test_a_mutated_plan_file_is_read_or_refused_with_a_plan_file_error(tmp_path_factory, case):
    kind, text = case
    path = tmp_path_factory.getbasetemp() / "fuzzed-plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        plan = (Plan if kind == "plan" else SavedPlan).load(path)
    except PlanFileError as exc:
        assert exc.fix and exc.where, exc
        return
    if kind == "plan":                # what was read round-trips
        assert Plan.from_json(plan.to_json()) == plan
    else:
        assert SavedPlan.from_json(plan.to_json()) == plan


_BAD = ["0", "-1", "nan", "inf", "1e999", "99999999999999999999", "x", "", "2.5", "\uff12"]
_TINY = ["--model", "gpt", "--set", "layers=2", "--set", "hidden=32", "--set", "heads=4", "--set", "vocab=64"]
_GOOD = {"--seq": ["8", "16"], "--batch": ["4", "8", "6"], "--cluster": ["1x2", "1x4", "2x2", "1x3"],
         "--tp": ["1", "2", "4", "auto", "3"], "--pp": ["1", "2", "auto"], "--dp": ["1", "2"],
         "--memory-budget": ["80", "0.001"], "--microbatches": ["2", "4"], "--virtual-stages": ["1", "2"],
         "--top": ["0", "2"], "--zero": ["auto", "1", "3"], "--micro-batch-size": ["1", "2"],
         "--bucket-bytes": ["0", "1000000"], "--mesh": ["tp=2", "dp=2,tp=2", "pp=2"]}
_FLAGS = {"plan": ["--tp", "--pp", "--memory-budget", "--microbatches", "--virtual-stages", "--top", "--zero"],
          "simulate": ["--tp", "--pp", "--dp", "--memory-budget", "--micro-batch-size", "--virtual-stages"],
          "dump": ["--bucket-bytes", "--mesh"]}


@st.composite
def command_lines(draw) -> list[str]:
    """``autopar plan`` / ``simulate`` / ``dump`` on a tiny gpt and a small cluster, each value
    valid or (one time in six) not, and now and then an output file that cannot be written."""
    def value(flag: str) -> str:
        bad = draw(st.integers(0, 5)) == 5
        return draw(st.sampled_from(_BAD + (["100000x8", "0x8", "2^3"] if flag == "--cluster" else [])
                                    if bad else _GOOD[flag]))

    command = draw(st.sampled_from(["plan", "plan", "simulate", "dump"]))
    argv = [command, *_TINY, "-q"]
    for flag in ["--seq", "--batch"] + (["--cluster"] if command != "dump" else []):
        argv.append(f"{flag}={value(flag)}")
    for flag in draw(st.lists(st.sampled_from(_FLAGS[command]), max_size=2, unique=True)):
        argv.append(f"{flag}={value(flag)}")
    if draw(st.integers(0, 5)) == 5:
        out = {"plan": "--timeline", "simulate": "--timeline", "dump": "--out"}[command]
        argv.append(f"{out}={draw(st.sampled_from(['/nonexistent-autopar/x.svg', '/', '']))}")
    return argv


@settings(max_examples=14, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines())
def test_a_command_line_succeeds_or_exits_2_with_a_message(argv):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(argv)
    except SystemExit as done:        # argparse's own refusals (an unknown choice, a missing value)
        code = done.code
    assert code in (0, 2), f"{argv} exited {code}:\n{err.getvalue()}"
    if code == 2:
        assert "error:" in err.getvalue(), f"{argv}: exit 2 without a message"
