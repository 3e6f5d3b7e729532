"""Activations kept for backward: autopar against the plain eager model, per layer.

For each model (the zoo GPT and ``transformers`` Llama, Qwen2, Gemma 2, Mixtral and
DeepSeek-V3, small float32 configs of each), one forward of a batch of 2 x 256 tokens is run
under ``torch.autograd.graph.saved_tensors_hooks`` twice: the plain model, and the same model
through ``autopar.parallelize(model, {"dp": 1})`` with default options (one gloo rank). The bytes
kept are counted by unique storage. Per layer: the difference between a 4-layer and a 2-layer
build of the model, halved, so the embedding, the head and the loss drop out. Step time (one
forward and backward, median of 5) is measured for both, in the same run.

Usage: ``python bench/activation_memory.py [--json]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
logging.getLogger("autopar").setLevel(logging.ERROR)

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import run_ranks  # noqa: E402

BATCH, SEQ, VOCAB = 2, 256, 64       # the vocabulary of tests/test_ep_hf.py's models


def _hf(kind: str, layers: int) -> torch.nn.Module:
    import transformers
    from tests.hf_tiny import Logits
    common = dict(hidden_size=256, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=SEQ)
    cfg = {
        "llama": lambda: transformers.LlamaConfig(intermediate_size=688, **common),
        "qwen2": lambda: transformers.Qwen2Config(intermediate_size=688, **common),
        "gemma2": lambda: transformers.Gemma2Config(intermediate_size=688, head_dim=32, **common),
        "mixtral": lambda: transformers.MixtralConfig(intermediate_size=344, num_local_experts=4,
                                                      num_experts_per_tok=2, **common),
    }
    if kind == "deepseek_v3":      # tests/test_ep_hf.py's small DeepSeek-V3 (latent attention, routed experts)
        from tests.test_ep_hf import build
        return build(kind, torch.float32, num_hidden_layers=layers, first_k_dense_replace=0)
    cfg = cfg[kind]()
    return Logits(transformers.AutoModelForCausalLM.from_config(cfg))


def _model(name: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from autopar import models
        return models.build("gpt", {"hidden": 256, "heads": 8, "vocab": VOCAB, "max_seq": SEQ, "layers": layers},
                            device="cpu")
    return _hf(name, layers)


def _kept(fn) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _step_s(module, x: torch.Tensor) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = module(x)
        out.float().pow(2).mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(rank: int, world: int, name: str) -> dict:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kept, steps = {}, {}
    for layers in (2, 4):
        plain = _model(name, layers)
        ours = autopar.parallelize(copy.deepcopy(plain), {"dp": 1}, (x,))
        kept[layers] = (_kept(lambda: plain(x)), _kept(lambda: ours(x)))
        if layers == 4:
            steps = {"plain": _step_s(plain, x), "autopar": _step_s(ours, x)}
    eager = (kept[4][0] - kept[2][0]) / 2
    mine = (kept[4][1] - kept[2][1]) / 2
    return {"model": name, "eager_layer_mib": eager / 2**20, "autopar_layer_mib": mine / 2**20,
            "ratio": mine / eager, "eager_step_s": steps["plain"], "autopar_step_s": steps["autopar"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="activation_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="comma-separated model names")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else ["gpt", "llama", "qwen2", "gemma2", "mixtral", "deepseek_v3"]
    rows = []
    print(f"{'model':<12} {'eager MiB/layer':>16} {'autopar MiB/layer':>18} {'ratio':>6} {'step eager':>11} "
          f"{'step autopar':>13}")
    for name in names:
        r = run_ranks(_row, 1, name, timeout_s=900)[0]
        rows.append(r)
        print(f"{name:<12} {r['eager_layer_mib']:>16.2f} {r['autopar_layer_mib']:>18.2f} {r['ratio']:>6.2f} "
              f"{r['eager_step_s']:>10.3f}s {r['autopar_step_s']:>12.3f}s", flush=True)
    if args.json:
        print(json.dumps({"bench": "activation_memory", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
