"""Activations kept for backward: autopar against the plain eager model, per layer.

For each model (the zoo GPT and ``transformers`` Llama, Qwen2, Gemma 2, Mixtral and
DeepSeek-V3, small float32 configs of each), one forward of a batch of 2 x 256 tokens is run
under ``torch.autograd.graph.saved_tensors_hooks`` twice: the plain model, and the same model
through ``autopar.parallelize(model, {"dp": 1})`` with default options (one gloo rank), and once
more with the fusion pass (``passes/fusion.py``) left out. The bytes kept are counted by unique
storage, less the storages of parameters and buffers (a matmul keeps its weight, which is held
anyway): activations only. Per layer: the difference between a 4-layer and a 2-layer build of
the model, halved, so the embedding, the head and the loss drop out. The hand count
(:func:`hand_count`) is what a layer with fused norms, MLP and attention must keep, itemised per
model. Step time (one forward and backward) is measured for all three in the same run, one step of
each in turn, :data:`ROUNDS` times (after two warm-up rounds), the builds in a new random order each
round: the median of each, as wall time and as the rank's CPU time, with the page faults per
step. A second unfused build (the twin) is timed beside them: its ratio to the first is how far
two identical builds fall apart in the run.

The timed rank keeps the memory it frees (glibc's ``mallopt``: no chunk mapped on its own, none
handed back to the system; :func:`_steady_malloc`): with glibc's defaults a step's large tensors
are mapped afresh and the pages faulted in again depending on what the build before it freed, and
the same code's step ratio moved between 1.00 and 1.12 from run to run. ``--system-malloc`` keeps
the defaults (the page-fault column then shows how many).

Usage: ``python bench/activation_memory.py [--only NAMES] [--wide] [--rounds N] [--system-malloc] [--json]``.
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

import os  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # tests/ for the tiny configs

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.runtime.launch import run_ranks  # noqa: E402

BATCH, SEQ, VOCAB = 2, 256, 64       # the vocabulary of tests/test_ep_hf.py's models
# Step timings of each build, taken one step of each in turn: drift in a shared machine's load
# then reaches them alike. The order is drawn anew each round (seeded), so no build always runs
# after the same neighbour, whose freed memory it would find in the same state.
ROUNDS = 60


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
    if kind == "deepseek_v3_wide":     # the same at the other rows' hidden size (the config's derived head sizes set too)
        from tests.test_ep_hf import build
        d = WIDE_DEEPSEEK
        return build("deepseek_v3", torch.float32, num_hidden_layers=layers, first_k_dense_replace=0,
                     hidden_size=d["hidden"], num_attention_heads=d["heads"], num_key_value_heads=d["heads"],
                     kv_lora_rank=d["latent"], qk_rope_head_dim=d["qk"] // 2, qk_nope_head_dim=d["qk"] // 2,
                     qk_head_dim=d["qk"], head_dim=d["qk"] // 2, v_head_dim=d["v"],
                     intermediate_size=688, moe_intermediate_size=d["expert"], max_position_embeddings=SEQ)
    cfg = cfg[kind]()
    return Logits(transformers.AutoModelForCausalLM.from_config(cfg))


def _model(name: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in ("gpt", "gpt_wide"):
        from autopar import models
        hidden, heads = (H, HEADS) if name == "gpt" else (WIDE_GPT, WIDE_GPT // 32)
        return models.build("gpt", {"hidden": hidden, "heads": heads, "vocab": VOCAB, "max_seq": SEQ, "layers": layers},
                            device="cpu")
    return _hf(name, layers)


def _steady_malloc() -> bool:
    """Make glibc's allocator keep what this process frees: every chunk from the heap (none mapped
    on its own, which ``free`` unmaps) and no trimming of the heap's top. Every build timed in
    the process gets the same allocator; the steps then fault no pages in. False where the C
    library has no ``mallopt`` (not glibc): the defaults stay."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's malloc.h
    # 32 MiB: the largest mapping threshold glibc takes on a 64-bit machine (the bench's tensors
    # are a few MiB); setting either also stops glibc from moving them as the process runs
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30))


def _state_storages(module: torch.nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers: held whether or not a step runs, so
    not activations (a matmul's saved weight is one of them)."""
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def _kept(fn, state: set[int]) -> tuple[int, int]:
    """(activation bytes, parameter and buffer bytes) autograd keeps for backward in one call of
    ``fn``, by unique storage."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    acts = sum(n for ptr, n in seen.items() if ptr not in state)
    return acts, sum(seen.values()) - acts


def _step_s(module, x: torch.Tensor) -> tuple[float, float, int]:
    """One forward and backward: (wall seconds, this thread's CPU seconds, minor page faults).
    The CPU time leaves out the time the machine ran something else (the rank has one thread,
    which runs forward and backward); the faults show the allocator handing memory back to the
    system and taking it again, which both clocks count."""
    f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time(), time.perf_counter()
    out = module(x)
    out.float().pow(2).mean().backward()
    t, c = time.perf_counter() - t0, time.thread_time() - c0
    return t, c, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


# -- the hand count: what one layer with fused norms, MLP and attention must keep ---------------
# Elements per token, float32. A norm keeps its input and one statistic per row (LayerNorm two);
# its output is recomputed for the projections that read it (q, k, v; gate, up) unless another
# op reads it too (a router beside the experts); every other matmul keeps its input; attention
# keeps q, k, v, its output and a log-sum-exp per head (no scores); SwiGLU / GeGLU keep both
# halves and GELU its input (their products are recomputed); an expert layer keeps each routed
# slot's input, halves and output (the routing weight's gradient reads the output) and the
# router's probabilities and weights.
H, HEADS, KV = 256, 8, 128           # hidden, query heads, key/value width (4 heads of 32)


def _attention(hidden: int, q: int, k: int, v: int, heads: int, norm_stats: int = 1) -> int:
    """Pre-norm attention block: norm input + stats, q, k, v, output, log-sum-exp."""
    return (hidden + norm_stats) + q + k + v + v + heads


def _gpt(h: int, heads: int) -> int:
    """LayerNorm (two statistics), 4h GELU MLP."""
    return _attention(h, h, h, h, heads, norm_stats=2) + (h + 2) + 4 * h


def _deepseek(h: int, heads: int, latent: int, qk: int, v: int, expert: int, experts: int = 4, top: int = 2,
              shared: int | None = None) -> int:
    """Pre-norm latent attention (the input norm, the latent norm; q, k per head of ``qk``, v and
    the output per head of ``v``, a log-sum-exp per head), then the post-attention norm, the
    router (reading the norm's output: kept), each routed slot's input, halves and output, and
    the shared expert's halves (its input is the norm's output, kept for the router)."""
    attention = (h + 1) + (latent + 1) + 2 * heads * qk + 2 * heads * v + heads
    shared = expert if shared is None else shared
    return attention + (h + 1) + h + experts + top + top * (h + 2 * expert + h) + 2 * shared


# The wide rows (``--wide``): the two models whose step ratio depends most on their size, GPT at
# hidden 1024 (32 heads of 32) and DeepSeek-V3 at the other rows' hidden 256 (8 heads; latent
# 128; query and key heads of 64, half rotary; value heads of 32; experts of 344).
WIDE_GPT = 1024
WIDE_DEEPSEEK = {"hidden": 256, "heads": 8, "latent": 128, "qk": 64, "v": 32, "expert": 344}


def hand_count(name: str) -> int:
    """Elements per token per layer a fused layer of ``name`` keeps (the configs above)."""
    if name == "gpt":
        return _gpt(H, HEADS)
    if name == "gpt_wide":
        return _gpt(WIDE_GPT, WIDE_GPT // 32)
    if name == "deepseek_v3_wide":
        d = WIDE_DEEPSEEK
        return _deepseek(d["hidden"], d["heads"], d["latent"], d["qk"], d["v"], d["expert"])
    block = _attention(H, H, KV, KV, HEADS)
    mlp_norm = H + 1                                          # post-attention norm: input + stat
    if name in ("llama", "qwen2"):
        return block + mlp_norm + 2 * 688
    if name == "gemma2":             # two more norms (after attention and after the MLP): input + stat
        return block + mlp_norm + 2 * (H + 1) + 2 * 688
    if name == "mixtral":            # 4 experts, top-2, expert width 344; the router reads the norm's output
        return block + mlp_norm + H + 4 + 2 + 2 * (H + 2 * 344 + H)
    if name == "deepseek_v3":        # hidden 32, 4 heads, latent 16, rope 8 + nope 8, v 8, 4 experts of 24, 1 shared
        return _deepseek(32, 4, 16, 16, 8, 24)
    raise KeyError(name)


def _row(rank: int, world: int, name: str, system_malloc: bool = False, rounds: int = ROUNDS) -> dict:
    import autopar.passes.fusion as fusion
    steady = False if system_malloc else _steady_malloc()
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kept: dict[int, dict[str, tuple[int, int]]] = {}
    steps: dict[str, list[tuple[float, float, int]]] = {}
    fuse = fusion.fuse
    for layers in (2, 4):
        plain = _model(name, layers)
        ours = autopar.parallelize(copy.deepcopy(plain), {"dp": 1}, (x,))
        fusion.fuse = lambda gm: 0                 # the same build with the fusion pass left out
        try:
            unfused = autopar.parallelize(copy.deepcopy(plain), {"dp": 1}, (x,))
            # a second one, timed beside the first: how far two identical builds' medians
            # fall apart in this run (the resolution of the step column)
            twin = autopar.parallelize(copy.deepcopy(plain), {"dp": 1}, (x,)) if layers == 4 else None
        finally:
            fusion.fuse = fuse
        kept[layers] = {k: _kept(lambda: m(x), _state_storages(m))
                        for k, m in (("plain", plain), ("autopar", ours), ("unfused", unfused))}
        if layers == 4:
            builds = [("plain", plain), ("autopar", ours), ("unfused", unfused), ("twin", twin)]
            order = random.Random(0)
            for i in range(rounds + 2):            # in turn, so drift in the machine reaches each alike
                order.shuffle(builds)
                for k, m in builds:
                    t = _step_s(m, x)
                    if i >= 2:
                        steps.setdefault(k, []).append(t)
    per = {k: (kept[4][k][0] - kept[2][k][0]) / 2 / 2**20 for k in kept[4]}
    state = {k: (kept[4][k][1] - kept[2][k][1]) / 2 / 2**20 for k in kept[4]}
    hand = hand_count(name) * BATCH * SEQ * 4 / 2**20

    def med(k: str, i: int) -> float:
        return statistics.median(s[i] for s in steps[k])
    return {"model": name, "eager_layer_mib": per["plain"], "autopar_layer_mib": per["autopar"],
            "unfused_layer_mib": per["unfused"], "hand_layer_mib": hand, "ratio": per["autopar"] / per["plain"],
            "ratio_with_weights": (per["autopar"] + state["autopar"]) / (per["plain"] + state["plain"]),
            "vs_hand": per["autopar"] / hand, "weights_layer_mib": state["plain"],
            **{f"{k}_step_s": statistics.median(t for t, _, _ in v) for k, v in steps.items()},
            **{f"{k}_step_cpu_s": statistics.median(c for _, c, _ in v) for k, v in steps.items()},
            **{f"{k}_faults": statistics.median(f for _, _, f in v) for k, v in steps.items()},
            "step_vs_unfused": med("autopar", 0) / med("unfused", 0),
            "cpu_vs_unfused": med("autopar", 1) / med("unfused", 1),
            "twin_vs_unfused": med("twin", 0) / med("unfused", 0),
            "twin_cpu_vs_unfused": med("twin", 1) / med("unfused", 1), "steady_malloc": steady}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="activation_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--wide", action="store_true",
                    help="the wide rows instead: GPT at hidden 1024, DeepSeek-V3 at hidden 256 (WIDE_GPT, WIDE_DEEPSEEK)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per build (default {ROUNDS})")
    ap.add_argument("--system-malloc", action="store_true",
                    help="time the steps with glibc's default allocator settings (memory handed back and faulted in again)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else \
        ["gpt_wide", "deepseek_v3_wide"] if args.wide else ["gpt", "llama", "qwen2", "gemma2", "mixtral", "deepseek_v3"]
    rows = []
    print("| model | eager MiB | autopar MiB | ratio (goal <= 0.75) | with weights | hand count MiB | autopar / hand | "
          "autopar unfused MiB | step eager / unfused / autopar (s) | autopar / unfused step (goal <= 1.03) | "
          "CPU time | twin / unfused step, CPU | page faults per step eager / unfused / autopar |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = run_ranks(_row, 1, name, args.system_malloc, args.rounds, timeout_s=3600)[0]
        rows.append(r)
        print(f"| {name} | {r['eager_layer_mib']:.2f} | {r['autopar_layer_mib']:.2f} | {r['ratio']:.2f} | "
              f"{r['ratio_with_weights']:.2f} | "
              f"{r['hand_layer_mib']:.2f} | {r['vs_hand']:.2f} | {r['unfused_layer_mib']:.2f} | "
              f"{r['plain_step_s']:.3f} / {r['unfused_step_s']:.3f} / {r['autopar_step_s']:.3f} | "
              f"{r['step_vs_unfused']:.3f} | {r['cpu_vs_unfused']:.3f} | "
              f"{r['twin_vs_unfused']:.3f}, {r['twin_cpu_vs_unfused']:.3f} | "
              f"{r['plain_faults']:.0f} / {r['unfused_faults']:.0f} / {r['autopar_faults']:.0f} |", flush=True)
    if args.json:
        print(json.dumps({"bench": "activation_memory", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
