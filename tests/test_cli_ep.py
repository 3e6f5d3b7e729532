"""``autopar plan`` on a mixture-of-experts model reports how to split the experts."""
from __future__ import annotations

import json

from autopar.cli import main


def test_plan_reports_expert_choices(capsys):
    code = main(["plan", "--pp", "1", "--model", "moe", "--set", "layers=2", "--set", "hidden=256", "--set", "experts=8",
                 "--cluster", "2x4", "--hardware", "h100", "--batch", "16", "--seq", "512", "--json", "-q"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    ex = data["experts"]
    chosen, alts = ex["chosen"], ex["alternatives"]
    assert chosen["mode"] in ("replicated", "ep", "tp")
    assert all(c["mode"] != "ep+tp" for c in alts)          # only what the runtime can run
    dp = data["degrees"]["dp"]
    assert all(dp % c["ep"] == 0 and 8 % c["ep"] == 0 for c in [chosen, *alts])
    assert all(c["reason"] for c in alts)
    # the exchange is priced wherever experts are split over ep, and only there
    assert all((c["all_to_all_s"] > 0) == (c["ep"] > 1) for c in [chosen, *alts])
    times = [c["time_s"] for c in [chosen, *alts] if c["fits"]]
    assert chosen["time_s"] == min(times)
