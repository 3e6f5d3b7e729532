"""Rough edges from issue 19: the report's planner time, memory budgets as sizes, a word when
tp splits nothing, and -q silencing warnings."""
from __future__ import annotations

import logging
import re
import textwrap

import pytest
import torch
from torch import nn

import autopar
from autopar.build.checks import memory_bytes
from autopar.cli import main
from autopar.core.errors import ConfigError
from autopar.passes.sharding import reset_warnings


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()


# ---- 1. the HTML report shows the measured planner time ------------------------------------

def test_report_shows_the_measured_planner_time(tmp_path, capsys):
    out = tmp_path / "plan.html"
    code = main(["plan", "--model", "gpt", "--set", "layers=1", "--cluster", "1x2", "--batch", "4", "--seq", "8",
                 "--report", str(out), "-q"])
    capsys.readouterr()
    assert code == 0
    shown = re.search(r"planner time</th><td>([^<]+)</td>", out.read_text()).group(1)
    assert shown != "0 us" and float(shown.split()[0]) > 0, shown


# ---- 2. memory_budget: bytes, or a size with a unit ----------------------------------------

@pytest.mark.parametrize("given,nbytes", [
    ("40GB", 40e9), ("40 GiB", 40 * 2**30), ("512MB", 512e6), ("1.5 gb", 1.5e9), ("2TiB", 2 * 2**40),
    (80e9, 80e9), (1024, 1024), (None, None),
])
def test_memory_budget_reads_sizes_and_keeps_numbers_as_bytes(given, nbytes):
    assert memory_bytes(given) == nbytes


@pytest.mark.parametrize("bad", ["40", "40 GX", "lots", "", "GB", "-5GB"])
def test_a_bad_memory_budget_string_is_a_config_error_with_a_fix(bad):
    with pytest.raises(ConfigError) as err:
        memory_bytes(bad)
    text = str(err.value)
    assert "memory_budget" in text and repr(bad) in text and "fix:" in text and "40GB" in text


def test_plan_takes_a_memory_budget_string():
    model, x = Tiny(), torch.randn(4, 8)
    assert autopar.plan(model, {"tp": 2}, (x,), memory_budget="1GB").params == \
        autopar.plan(model, {"tp": 2}, (x,), memory_budget=1e9).params
    with pytest.raises(ConfigError, match="needs a number and a unit"):
        autopar.plan(model, {"tp": 2}, (x,), memory_budget="1 gigabyte")


def test_parallelize_takes_a_memory_budget_string(fake_world):
    fake_world(2)
    pm = autopar.parallelize(Tiny(), {"dp": 2}, (torch.randn(4, 8),), memory_budget="2 GiB")
    assert pm(torch.randn(4, 8)).shape == (4, 8)


# ---- 3. a tensor axis that splits nothing says so, once ------------------------------------

def test_a_plan_that_splits_nothing_says_so_and_why(fake_world, caplog):
    class Odd(nn.Module):       # 3 x 5: no dimension divides by 2
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x)

    fake_world(2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        autopar.parallelize(Odd(), {"tp": 2}, (torch.randn(4, 5),))
    lines = [r.getMessage() for r in caplog.records if "splits no parameter" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "tp=2" in lines[0] and "no parameter has a dimension divisible by 2" in lines[0]


def test_replication_chosen_by_cost_says_the_cost_model_chose_it(fake_world, caplog):
    fake_world(2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        autopar.parallelize(Tiny(), {"tp": 2}, (torch.randn(4, 8),))     # too small for a split to pay off
    lines = [r.getMessage() for r in caplog.records if "splits no parameter" in r.getMessage()]
    assert len(lines) == 1 and "cost model found replication cheaper" in lines[0], lines


def test_a_plan_that_splits_something_says_nothing(fake_world, caplog):
    fake_world(2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        autopar.parallelize(Tiny(), {"tp": 2}, (torch.randn(4, 8),), placements={"fc.weight": "S(0)"})
    assert not [r for r in caplog.records if "splits no parameter" in r.getMessage()]


# ---- 4. -q silences "no sharding rule" -----------------------------------------------------

def _flip_model(tmp_path):
    f = tmp_path / "flip.py"     # aten.flip has no sharding rule
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Flip(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
            def forward(self, x):
                return torch.flip(self.fc(x), [-1])

        def make(batch, seq):
            return Flip(), (torch.randn(batch, 8),), ({0: "batch"},)
    """))
    return f"{f}:make"


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_silences_the_no_sharding_rule_warning(tmp_path, capsys, caplog, quiet):
    reset_warnings()            # the warning is once per process
    argv = ["dump", "--model", _flip_model(tmp_path), "--batch", "2", "--mesh", "tp=2", *(["-q"] if quiet else [])]
    assert main(argv) == 0
    said = capsys.readouterr().err + "\n".join(r.getMessage() for r in caplog.records)
    assert ("no sharding rule for aten.flip" in said) is not quiet
    assert logging.getLogger("autopar").level == logging.NOTSET     # -q does not leak past the command


def test_the_cli_says_its_version(capsys):
    import autopar
    from autopar.cli import main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"


def test_python_dash_m_autopar_train_is_the_train_command():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "autopar.cli.train", "--ranks", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "autopar: error: --ranks" in proc.stderr and "Traceback" not in proc.stderr
