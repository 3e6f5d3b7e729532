"""Every bad input raises its own AutoparError subclass, and the message names the offending
thing (module, node, parameter, file, rank count) and says how to fix it.

Most checks run before any collective, so they need no ranks: ``autopar.plan`` needs none,
and ``parallelize`` runs on a fake process group (``torch.distributed``'s "fake" backend:
one process that believes it is one of N ranks; collectives do nothing). One test runs
real gloo ranks: the solver avoids a dim the tensor axis does not divide, and the plan works.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopar
from autopar import (CaptureError, DoesNotFitError, InputMismatchError, MeshError, OptimizerError, PlanFileError,
                     ShardingError, UnsupportedError, models)
from autopar.core.placement import Shard, parse
from autopar.core.plans import Plan
from autopar.runtime.launch import run_ranks


class MLP(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(8, hidden)
        self.down = nn.Linear(hidden, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        y = self.inner(x)
        if y.sum() > 0:    # data-dependent branch
            return y * 2
        return y


def _x(batch: int = 4, width: int = 8, **kw) -> torch.Tensor:
    return torch.randn(batch, width, **kw)


def _says(err: pytest.ExceptionInfo, *needles: str) -> str:
    text = str(err.value)
    for needle in (*needles, "fix:"):
        assert needle in text, f"{needle!r} not in:\n{text}"
    return text


# ---- capture and inputs -------------------------------------------------------------------

def test_data_dependent_control_flow_is_a_capture_error_naming_module_and_line():
    with pytest.raises(CaptureError) as err:
        autopar.plan(Branchy(), {"tp": 2}, (_x(width=4),))
    _says(err, "<root> (Branchy)", "test_errors.py", "if y.sum() > 0")


def test_wrong_number_of_inputs_is_an_input_mismatch():
    with pytest.raises(InputMismatchError) as err:
        autopar.plan(MLP(), {"tp": 2}, (_x(), _x()))
    _says(err, "MLP.forward", "2 positional input(s)")


def test_wrong_input_shape_is_an_input_mismatch_naming_the_module():
    with pytest.raises(InputMismatchError) as err:
        autopar.plan(MLP(), {"tp": 2}, (_x(width=5),))
    _says(err, "up (Linear)", "4x5", "Tensor(4, 5)")


def test_wrong_input_dtype_is_an_input_mismatch_naming_the_node():
    with pytest.raises(InputMismatchError) as err:
        autopar.plan(MLP(), {"tp": 2}, (torch.randint(0, 3, (4, 8)),))
    _says(err, "node linear", "module up", "int64", "float32")


def test_calling_the_parallel_model_with_other_inputs_is_an_input_mismatch(fake_world):
    fake_world(2)
    pm = autopar.parallelize(MLP(), {"tp": 2}, (_x(),))
    pm(_x(batch=6))                               # the batch is symbolic: any size
    with pytest.raises(InputMismatchError) as err:
        pm(_x(width=5))
    _says(err, "input 0", "float32 [*, 8]", "[4, 5]")
    with pytest.raises(InputMismatchError) as err:
        pm(_x(dtype=torch.float64))
    _says(err, "input 0", "float64 [4, 8]")
    with pytest.raises(InputMismatchError):
        autopar.parallelize(lambda x: x, {"tp": 2}, (_x(),))


# ---- sharding -----------------------------------------------------------------------------

def test_forced_split_of_an_indivisible_dim_names_parameter_and_sizes():
    with pytest.raises(ShardingError) as err:
        autopar.plan(MLP(hidden=6), {"tp": 4}, (_x(),), placements={"up.weight": "S(0)"})
    _says(err, "up.weight", "dim 0 of size 6", "tensor axis of size 4")


def test_an_edited_plan_splitting_an_indivisible_dim_is_refused():
    model = MLP(hidden=6)
    good = autopar.plan(model, {"tp": 4}, (_x(),))
    bad = Plan.from_json(good.to_json().replace('"up.weight": "R"', '"up.weight": "S(0)"'))
    assert bad.params["up.weight"] == "S(0)"
    with pytest.raises(ShardingError) as err:
        autopar.build.prepare.planned_graph(model, {"tp": 4}, (_x(),), plan=bad)
    _says(err, "parameter up.weight", "size 6", "size 4")


def test_forced_placements_are_honoured_where_they_divide():
    plan = autopar.plan(MLP(hidden=8), {"tp": 4}, (_x(),), placements={"up.weight": "S(1)", "down.weight": "R"})
    assert plan.params["up.weight"] == "S(1)" and plan.params["down.weight"] == "R"


def test_sequence_parallel_needs_a_bool_and_a_sequence_dim():
    from autopar.core.errors import ConfigError
    gpt = models.build("gpt", dict(layers=1, hidden=16, heads=4, vocab=32, max_seq=8), device="meta")
    tokens, _ = models.example_inputs(gpt, 2, 8, device="meta")
    with pytest.raises(ConfigError) as err:
        autopar.plan(gpt, {"tp": 2}, tokens, sequence_parallel="yes")
    _says(err, "sequence_parallel", "'yes'", "None", "True or False")
    with pytest.raises(ConfigError) as err:          # the MLP's input has no dim named "seq"
        autopar.plan(MLP(), {"tp": 2}, (_x(),), sequence_parallel=False)
    _says(err, "no input dim is named 'seq'", 'dims=({0: "batch", 1: "seq"},)')
    with pytest.raises(ConfigError) as err:          # nothing to split it over
        autopar.plan(gpt, {"dp": 2}, tokens, sequence_parallel=True)
    _says(err, "sequence_parallel=True needs a tensor axis", "add a tp axis")


def test_sequence_parallel_with_a_plan_or_a_pipeline_is_refused(fake_world):
    from autopar.core.errors import ConfigError
    fake_world(2)
    plan = autopar.plan(MLP(), {"tp": 2}, (_x(),))
    with pytest.raises(ConfigError) as err:
        autopar.parallelize(MLP(), 2, (_x(),), plan=plan, sequence_parallel=False)
    _says(err, "sequence_parallel= and plan= are both given", "autopar.plan(..., sequence_parallel=...)")
    with pytest.raises(ConfigError) as err:
        autopar.parallelize(MLP(), {"pp": 2}, (_x(),), sequence_parallel=False)
    _says(err, "sequence_parallel cannot be used with a pipeline", "sequence_parallel=False")


def _hidden6_rank(rank: int, world: int, plan: Plan) -> dict:
    torch.manual_seed(0)
    model = MLP(hidden=6)
    ref = copy.deepcopy(model)
    x = _x()
    pm = autopar.parallelize(model, world, (x,), plan=plan)
    out, want = pm(x), ref(x)
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    refs = dict(ref.named_parameters())
    grad = 0.0
    for fqn, p in pm.named_parameters():
        g = refs[fqn].grad
        place = pm.placement_of(fqn)
        g = g.chunk(world, place.dim)[rank] if isinstance(place, Shard) else g
        grad = max(grad, (p.grad - g).abs().max().item())
    return {"out": (out - want).abs().max().item(), "grad": grad}


def test_unforced_plan_avoids_the_indivisible_dim_and_works():
    model = MLP(hidden=6)
    plan = autopar.plan(model, {"tp": 4}, (_x(),), memory_budget=1)    # as lean as possible
    shapes = dict(model.named_parameters())
    for fqn, text in plan.params.items():
        p = parse(text)
        assert not isinstance(p, Shard) or shapes[fqn].shape[p.dim] % 4 == 0, (fqn, text)
    assert any(text != "R" for text in plan.params.values()), "the lean plan split nothing"
    for res in run_ranks(_hidden6_rank, 4, plan, timeout_s=120):
        assert res["out"] < 1e-5 and res["grad"] < 1e-5, res


# ---- does not fit -------------------------------------------------------------------------

def test_a_model_over_the_budget_says_how_many_devices_would_fit():
    model = models.build("gpt", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "max_seq": 16}, device="meta")
    args, _ = models.example_inputs(model, 8, 8, device="meta")
    state = 16 * sum(p.numel() for p in model.parameters())
    with pytest.raises(DoesNotFitError) as err:
        autopar.plan(model, {"tp": 2}, args, memory_budget=state / 6)
    assert err.value.smallest_devices is not None and err.value.smallest_devices > 2
    _says(err, f"{err.value.smallest_devices} devices would fit", "memory_budget", "zero_stage=3")


def test_cli_plan_too_big_for_the_cluster_is_does_not_fit():
    from autopar.cli import build_parser
    args = build_parser().parse_args(["plan", "--model", "gpt", "--set", "layers=8", "--set", "hidden=4096",
                                      "--cluster", "1x2", "--hardware", "a100", "--batch", "16", "--seq", "1024",
                                      "--memory-budget", "4", "-q"])
    with pytest.raises(DoesNotFitError) as err:
        args.fn(args)
    assert err.value.smallest_devices is not None and err.value.smallest_devices > 2
    _says(err, f"{err.value.smallest_devices} devices", "4.0 GB per device")


# ---- plan files ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,needle", [("{not json", "not valid JSON"), ('{"version": 99}', "unknown version"),
                                          ('{"version": 3, "mesh": {"tp": 2}}', "missing or mistypes"),
                                          ('{"version": 3, "mesh": {"tp": 2}, "tp_axis": "tp", "params": {}, '
                                           '"nodes": {}, "zero_stage": 7}', "invalid field")])
def test_a_bad_plan_file_is_a_plan_file_error_naming_the_file(tmp_path, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanFileError) as err:
        Plan.load(path)
    _says(err, needle, str(path))


def test_a_plan_for_another_model_is_a_plan_file_error(tmp_path):
    path = tmp_path / "plan.json"
    autopar.plan(MLP(hidden=8), {"tp": 2}, (_x(),)).save(path)
    with pytest.raises(PlanFileError) as err:
        Plan.load(path, model=MLP(hidden=16))
    _says(err, "another model", "up.weight is [16, 8], the plan has [8, 8]", str(path))
    with pytest.raises(PlanFileError):       # parallelize checks before it needs a process group
        autopar.parallelize(MLP(hidden=16), {"tp": 2}, (_x(),), plan=str(path))


# ---- mesh ---------------------------------------------------------------------------------

def test_a_plan_applied_on_a_mesh_of_another_size_is_a_mesh_error(fake_world):
    plan = autopar.plan(MLP(), {"tp": 2}, (_x(),))
    fake_world(4)
    with pytest.raises(MeshError) as err:
        autopar.parallelize(MLP(), {"tp": 4}, (_x(),), plan=plan)
    _says(err, "{'tp': 2}", "{'tp': 4}")
    with pytest.raises(MeshError) as err:        # the plan's mesh on a world of 4 ranks
        autopar.parallelize(MLP(), 4, (_x(),), plan=plan)
    _says(err, "world size 4", "2 ranks")


def test_a_mesh_that_does_not_cover_the_world_is_a_mesh_error(fake_world):
    fake_world(4)
    with pytest.raises(MeshError) as err:
        autopar.parallelize(MLP(), {"dp": 2}, (_x(),))
    _says(err, "world size 4", "2 ranks")


def test_bad_mesh_specs_are_mesh_errors():
    from autopar.cost.cluster import validate_mesh
    with pytest.raises(MeshError) as err:
        autopar.plan(MLP(), {"tp": 2, "dp": 2}, (_x(),))
    _says(err, "data axis must be the outer", "('tp', 2)")
    with pytest.raises(MeshError) as err:
        validate_mesh([("dp", 2), ("tp", 4)], world_size=16)
    _says(err, "8 ranks", "16")


# ---- unsupported dtypes and devices -------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Complex modules")
def test_a_complex_model_is_unsupported():
    model = MLP().to(torch.complex64)
    with pytest.raises(UnsupportedError) as err:
        autopar.plan(model, {"tp": 2}, (_x(dtype=torch.complex64),))
    _says(err, "parameter up.weight", "complex64")


def test_a_meta_model_cannot_be_parallelized():
    model = MLP().to("meta")
    with pytest.raises(UnsupportedError) as err:
        autopar.parallelize(model, {"tp": 2}, (_x(device="meta"),))
    _says(err, "meta device", "parameter up.weight", "to_empty")
    autopar.plan(model, {"tp": 2}, (_x(device="meta"),))    # planning on meta is what meta is for


class IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.arange(8), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.table.float()


def test_integer_parameter_under_zero3_is_unsupported(fake_world):
    fake_world(2)
    with pytest.raises(UnsupportedError) as err:
        autopar.parallelize(IntParam(), {"dp": 2}, (_x(),), zero_stage=3)
    _says(err, "parameter table", "int64", "register_buffer")


def test_float64_under_mixed_precision_is_unsupported(fake_world):
    fake_world(2)
    with pytest.raises(UnsupportedError) as err:
        autopar.parallelize(MLP().double(), {"dp": 2}, (_x(dtype=torch.float64),), mixed_precision="bf16")
    _says(err, "float64", "parameter up.weight", "model.float()")


# ---- optimizer ----------------------------------------------------------------------------

def test_optimizer_over_parameters_the_parallel_model_does_not_hold(fake_world):
    fake_world(2)
    model = MLP()
    pm = autopar.parallelize(model, {"tp": 2}, (_x(),))
    with pytest.raises(OptimizerError) as err:
        autopar.optimizer(pm, torch.optim.AdamW, params=model.parameters(), lr=1e-3)
    _says(err, "not a parameter of this parallel model", "shape (8, 8)", "pm.parameters()")
    with pytest.raises(OptimizerError) as err:
        autopar.optimizer(pm, torch.optim.LBFGS)
    _says(err, "LBFGS", "elementwise")
    with pytest.raises(OptimizerError) as err:
        autopar.optimizer(model, torch.optim.AdamW)
    _says(err, "MLP", "autopar.parallelize")
    autopar.optimizer(pm, torch.optim.AdamW, params=[{"params": list(pm.parameters())}], lr=1e-3)


def test_every_error_is_a_config_error_where_it_was_one():
    from autopar import AutoparError, ConfigError
    for cls in (ShardingError, DoesNotFitError, PlanFileError, MeshError, UnsupportedError, OptimizerError):
        assert issubclass(cls, ConfigError)
    for cls in (CaptureError, InputMismatchError):
        assert issubclass(cls, AutoparError)


@pytest.mark.parametrize("mesh,option", [({"pp": 2}, {"bucket_bytes": 1 << 20}), ({"pp": 2}, {"calibration": _x()}),
                                         ({"ep": 2}, {"placements": {"up.weight": "S(0)"}}),
                                         ({"pp": 2}, {"mixed_precision": "fp8"})])
def test_an_option_the_build_would_drop_is_refused(mesh, option):
    with pytest.raises(autopar.ConfigError) as err:
        autopar.parallelize(MLP(), mesh, (_x(),), **option)
    assert next(iter(option)) in str(err.value) and "fix:" in str(err.value)


def test_mixed_precision_other_than_the_plans_is_refused():
    plan = autopar.plan(MLP(), {"dp": 2}, (_x(),), mixed_precision="bf16")
    with pytest.raises(autopar.ConfigError) as err:
        autopar.parallelize(MLP(), {"dp": 2}, (_x(),), plan=plan, mixed_precision="fp16")
    _says(err, "differs from the plan's", "'bf16'", "'fp16'")


class _ChangesItsWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.weight.mul_(0.5)
        return self.fc(x)


def test_an_in_place_change_of_a_parameter_in_forward_is_named_with_its_line() -> None:
    with pytest.raises(CaptureError) as err:
        autopar.capture(_ChangesItsWeight(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "self.fc.weight.mul_(0.5)" in msg and "changes a parameter in place" in msg
