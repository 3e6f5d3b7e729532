"""Run as two torchrun "nodes" of 2 ranks on localhost by tests/test_nodes.py: autopar's own
mesh (a tp=4 plan scaled to the 4 ranks) and a user's ``{"tp": 4}``; rank 0 writes what each
rank's node is, the tensor-parallel groups of both meshes and the warnings to ``OUT``."""
from __future__ import annotations

import json
import logging
import sys

import torch
import torch.distributed as dist


def main(out: str) -> None:
    import autopar
    from autopar import models
    from autopar.core.saved_plan import SavedPlan
    from autopar.runtime.nodes import node_of_ranks
    autopar.init_distributed()
    torch.set_num_threads(1)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())
    logging.getLogger("autopar").addHandler(Keep(level=logging.WARNING))
    saved = SavedPlan.from_dict({
        "format": "autopar plan", "version": 1, "model": "gpt", "overrides": {}, "cluster": "1x4", "hardware": "cpu",
        "devices": 4, "batch": 4, "seq": 8, "dtype": "fp32",
        "config": {"dp": 1, "tp": 4, "pp": 1, "micro_batch": 4, "schedule": "1f1b", "virtual": 1, "recompute": "none",
                   "zero_stage": 0, "ep": 1}, "microbatches": 1, "predicted": {"step_time_s": 0.01}})
    scaled = autopar.scale_plan(saved)           # 4 ranks, LOCAL_WORLD_SIZE=2 from torchrun
    result = {"nodes": list(node_of_ranks()), "scaled_mesh": scaled.mesh, "notes": list(scaled.notes)}
    for name, mesh in (("own", scaled.mesh), ("user", {"tp": 4})):
        torch.manual_seed(0)
        model = models.build("gpt", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 64, "max_seq": 16}, device="cpu")
        x = torch.randint(0, 64, (4, 8))
        dp = mesh.get("dp", 1)
        local = x.chunk(dp)[dist.get_rank() // mesh["tp"]] if dp > 1 else x
        before = len(warnings)
        pm = autopar.parallelize(model, mesh, (local,), memory_budget=1)
        groups = [None] * dist.get_world_size()
        dist.all_gather_object(groups, dist.get_process_group_ranks(pm._mesh.get_group("tp")))
        split = sum(1 for f, _ in pm.named_parameters() if str(pm.placement_of(f)).startswith("S("))
        result[name] = {"tp_groups": groups, "split": split, "warnings": warnings[before:]}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
