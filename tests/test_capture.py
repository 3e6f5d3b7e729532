"""Capture: module paths, original names, meta device, clear errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar import CaptureError, InputMismatchError, capture
from autopar.core.meta import graph_info, info
from tests.conftest import TOKEN_DIMS, small


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.head(self.enc(x)) * self.scale


def test_nodes_carry_module_paths_and_params_keep_their_names():
    m = TwoLayer()
    gm = capture(m, (torch.randn(2, 8),))
    g = graph_info(gm)
    assert sorted(g.param_fqns.values()) == sorted(k for k, _ in m.named_parameters())
    assert sorted(g.buffer_fqns.values()) == ["scale"]
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert [info(n).fqn for n in linears] == ["enc.0", "head"]
    assert [info(n).module_type for n in linears] == ["Linear", "Linear"]
    relu = next(n for n in gm.graph.nodes if "relu" in str(n.target))
    assert info(relu).fqn == "enc.1"
    # every parameter placeholder knows its original state_dict key
    for n in gm.graph.nodes:
        if info(n).kind == "param":
            assert info(n).target_fqn in dict(m.named_parameters())


def test_meta_device_capture_allocates_nothing():
    from autopar import models
    m = models.build("llama", {"hidden": 512, "layers": 2}, device="meta")
    args, dims = models.example_inputs(m, 2, 8, device="meta")
    gm = capture(m, args, dims=dims)
    assert all(p.is_meta for p in m.parameters())
    assert graph_info(gm).symbols.keys() == {"batch", "seq"}


def test_symbolic_dims_are_named_batch_and_seq():
    m = small("gpt", layers=1)
    gm = capture(m, (torch.randint(0, 100, (2, 8)),), dims=TOKEN_DIMS)
    x = next(n for n in gm.graph.nodes if info(n).kind == "input")
    from autopar.passes.shapes import shape_pass
    shape_pass(gm)
    assert [str(s) for s in info(x).value.shape] == ["batch", "seq"]
    assert graph_info(gm).example_sizes == {"batch": 2, "seq": 8}


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Branchy()

    def forward(self, x):
        return self.inner(x)


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch: not capturable
            return x * 2
        return x


def test_uncapturable_model_names_module_and_source_line():
    with pytest.raises(CaptureError) as err:
        capture(DataDependent(), (torch.randn(3, 4),))
    msg = str(err.value)
    assert "inner (Branchy)" in msg
    assert "test_capture.py" in msg and "if x.sum() > 0" in msg
    assert "fix:" in msg


def test_wrong_number_of_inputs_is_an_input_mismatch():
    with pytest.raises(InputMismatchError) as err:
        capture(TwoLayer(), (torch.randn(2, 8), torch.randn(2, 8)))
    assert "forward" in str(err.value) and "fix:" in str(err.value)


def test_symbolic_dim_needs_example_size_two():
    with pytest.raises(InputMismatchError, match="at least 2"):
        capture(TwoLayer(), (torch.randn(1, 8),), dims=({0: "batch"},))


def test_not_a_module_is_rejected():
    with pytest.raises(InputMismatchError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


class _Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


def test_a_failed_capture_prints_autopar_error_only(capsys):
    """torch.export prints the partial graph of a failure to stderr; autopar keeps it for -v."""
    with pytest.raises(CaptureError) as err:
        capture(_Branches(), (torch.randn(2, 4),))
    assert "data" in err.value.fix
    printed = capsys.readouterr()
    assert "def forward" not in printed.err and "def forward" not in printed.out


class _Chunked(nn.Module):
    """Pads the sequence to a multiple of 4, as a chunked scan does, then runs layers the trace
    reaches only after that (``_TRACED`` counts how often their code runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (4 - x.shape[1] % 4) % 4
        h = self.inp(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad > 0 else x)
        h = h.reshape(x.shape[0], -1, 4, 8).sum(2)
        _TRACED.append(1)
        return self.out(h)


_TRACED: list[int] = []


def test_a_size_the_model_pins_stops_the_symbolic_capture_at_its_guard():
    """The model's code branches on seq % 4: every seq in the labelled range is not one graph, so
    the symbolic capture is refused (as torch.export refuses it after its whole trace), but at the
    guard itself: the code after it is never traced. The message names the guard and a size it
    fails at; the fixed-size capture of the same model works."""
    model, x = _Chunked(), torch.randn(2, 8, 8)
    _TRACED.clear()
    with pytest.raises(CaptureError) as err:
        capture(model, (x,), dims=({0: "batch", 1: "seq"},), cache=None)
    msg = str(err.value)
    assert "Constraints violated" in msg and "fails at" in msg and "inside the labelled range" in msg, msg
    assert not _TRACED
    gm = capture(model, (x,), cache=None)
    assert len(_TRACED) == 1 and not graph_info(gm).symbols
    # a model that only reads a size as a whole is captured with it symbolic, as before
    assert set(graph_info(capture(TwoLayer(), (torch.randn(3, 8),), dims=({0: "batch"},), cache=None)).symbols) \
        == {"batch"}
