"""The data-axis modes' pieces against their definitions, in one process: compressors,
error-feedback memory, gossip topologies, the mode's options and the errors for what does not
compose (raised before any collective)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.core.dp_mode import DataMode, data_mode
from autopar.core.errors import ConfigError, PlanFileError
from autopar.core.plans import Plan
from autopar.runtime import data_modes as dm


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2, 1.0, -1.5])
    vals, idx = dm.topk(x, 3)
    assert len(idx) == 3 and sorted(idx.tolist()) == [1, 3, 6]
    torch.testing.assert_close(vals, x[idx])
    assert dm.keep_count(1000, 0.01) == 10 and dm.keep_count(7, 0.01) == 1 and dm.keep_count(7, 1.0) == 7


@pytest.mark.parametrize("shape", ["normal", "heavy", "ties", "sorted", "spike"])
def test_topk_of_a_large_bucket_is_the_exact_selection(shape):
    """Above ``8 x SAMPLE`` entries the selection starts from a sampled threshold; whatever the
    entries look like, the set chosen is the k largest magnitudes."""
    g = torch.Generator().manual_seed(1)
    n, k = 200_003, 200
    x = {"normal": lambda: torch.randn(n, generator=g),
         "heavy": lambda: torch.randn(n, generator=g) ** 5,
         "ties": lambda: torch.randint(-3, 4, (n,), generator=g).float(),
         "sorted": lambda: torch.linspace(-1, 1, n),
         "spike": lambda: torch.zeros(n).index_fill_(0, torch.arange(0, n, 997), 1.0)
         * torch.randn(n, generator=g)}[shape]()
    vals, idx = dm.topk(x, k)
    assert len(idx) == k and len(set(idx.tolist())) == k and torch.equal(vals, x[idx])
    want = torch.topk(x.abs(), k).values
    assert torch.equal(vals.abs().sort(descending=True).values, want)      # the same magnitudes


def test_randk_draws_distinct_indices_alike_for_the_same_seed():
    a = dm.randk_indices(100, 10, torch.Generator().manual_seed(3))
    b = dm.randk_indices(100, 10, torch.Generator().manual_seed(3))
    c = dm.randk_indices(100, 10, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) == 10 and a.max() < 100


def test_random_quantization_is_unbiased_and_on_its_levels():
    torch.manual_seed(0)
    n, levels, draws = 2 * dm.QUANT_CHUNK + 100, 5, 3000        # two whole chunks and a partial one
    x = torch.randn(n, dtype=torch.float64)
    chunks = [x[i:i + dm.QUANT_CHUNK] for i in range(0, n, dm.QUANT_CHUNK)]
    maxima = dm.chunk_maxima(x)
    torch.testing.assert_close(maxima, torch.stack([c.abs().max() for c in chunks]).float())
    shared = maxima * 1.5            # a larger shared scale (another rank's maxima) keeps it unbiased
    g = torch.Generator().manual_seed(0)
    for scale in (maxima, shared):
        total = torch.zeros_like(x)
        for i in range(draws):
            q = dm.quantize(x, scale, levels, g)
            total += dm.dequantize(q, scale, levels, torch.float64)
            if i == 0:       # levels in [-levels, levels], signs kept, the chunk's largest entry at +-levels
                assert q.dtype == torch.int8 and q.abs().max() <= levels and bool((q * x.sign() >= 0).all())
        # each entry's rounding has variance <= (its chunk's scale / levels)^2 / 4: 5 standard errors
        per = torch.cat([torch.full_like(c, s.item()) for c, s in zip(chunks, scale.double())])
        assert bool(((total / draws - x).abs() < 5 * per / levels / 2 / draws ** 0.5).all())
    q = dm.quantize(x, maxima, levels, g)
    assert (dm.dequantize(q, maxima, levels, torch.float64) - x).abs().max() > 0   # not exact
    big = torch.tensor([x.abs().max().item()], dtype=torch.float64)                 # the largest entry is exact
    assert dm.quantize(big, big.float(), levels, g).item() == levels
    assert not dm.quantize(torch.zeros(4), torch.zeros(1), levels, g).any()
    # the sum over ranks of levels fits the integer type the all-reduce uses
    assert dm.level_dtype(4, 5) == torch.int8 and dm.level_dtype(26, 5) == torch.int16
    assert dm.level_dtype(7000, 5) == torch.int32
    # a bfloat16 gradient rounds in float32: levels + u would lose the probabilities in bfloat16
    xb = torch.full((dm.QUANT_CHUNK,), 0.3, dtype=torch.bfloat16)
    mb = torch.ones(1)
    ups = sum(int((dm.quantize(xb, mb, levels, g) == 2).sum()) for _ in range(20))
    frac = ups / (20 * dm.QUANT_CHUNK)                # 0.3 (as bfloat16) x 5 = 1.5: half of them round up
    assert abs(frac - (xb[0].float().item() * levels - 1)) < 0.03


def _quantize_all(x, add, divide, seed):
    """Scales, levels, residual and decoded levels of ``x / divide + add``, as the runtime runs them."""
    maxima = dm.chunk_maxima(x, add, divide)
    q, r = dm.quantize(x, maxima, 5, torch.Generator().manual_seed(seed), torch.int8, residual=True,
                       add=add, divide=divide)
    return maxima, q, r, dm.dequantize(q, maxima, 5, x.dtype)


def test_large_buckets_quantize_through_compiled_kernels_as_eagerly(monkeypatch):
    """From ``FUSE_MIN`` entries on, the scales, the rounding with its residual and the decoding
    run compiled (one pass each over the whole chunks; the partial chunk eagerly). They give the
    eager functions' scales and decoding bit for bit, the same levels up to entries within a
    rounding step of a boundary (a fused multiply-add may round those the other way), and a
    residual that is exactly what the levels leave out."""
    g = torch.Generator().manual_seed(0)
    n = 40 * dm.QUANT_CHUNK + 77
    x, have = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    monkeypatch.setattr(dm, "FUSE_MIN", 1 << 40)
    eager = _quantize_all(x, have, 3, seed=5)
    monkeypatch.setattr(dm, "FUSE_MIN", 1024)
    fused = _quantize_all(x, have, 3, seed=5)
    assert all(dm._KERNELS.get(f) not in (None, False) for f in (dm._row_maxima, dm._round_rows, dm._decode_rows))
    assert torch.equal(fused[0], eager[0])
    assert int((fused[1] != eager[1]).sum()) <= 2 and int((fused[1] - eager[1]).abs().max()) <= 1
    assert fused[1].abs().max() <= 5 and fused[1].dtype == torch.int8
    p = x / 3 + have
    torch.testing.assert_close(fused[2], p - fused[3], rtol=0, atol=1e-6)
    assert fused[2].abs().max() <= fused[0].repeat_interleave(dm.QUANT_CHUNK)[:n].max() / 5
    assert torch.equal(fused[3], dm.dequantize(fused[1], fused[0], 5, x.dtype))
    monkeypatch.setattr(dm, "FUSE_MIN", 1 << 40)
    assert torch.equal(fused[3], dm.dequantize(fused[1], fused[0], 5, x.dtype))    # decoding: bit for bit


def test_quantize_runs_eagerly_with_a_warning_where_compiling_fails(monkeypatch):
    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no C++ compiler")
        return run
    monkeypatch.setattr(dm, "_KERNELS", {})
    monkeypatch.setattr(dm.torch, "compile", broken)
    monkeypatch.setattr(dm, "FUSE_MIN", 1024)
    x = torch.randn(8 * dm.QUANT_CHUNK)
    with pytest.warns(RuntimeWarning, match="no C..? compiler.*run eagerly"):
        got = _quantize_all(x, None, 1, seed=1)
    assert dm._KERNELS[dm._row_maxima] is False
    monkeypatch.setattr(dm, "FUSE_MIN", 1 << 40)
    want = _quantize_all(x, None, 1, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_topk_of_a_weight_gradient_with_dead_columns_selects_from_candidates(monkeypatch):
    """A weight gradient's magnitude follows its columns (an input a ReLU zeroed gives a zero
    column). The threshold's sample sits at random places, so it sees the live columns too and
    the selection runs over the candidates, not over the whole bucket (a stride dividing the
    row length sampled only dead columns here, and every call fell back to the full selection)."""
    g = torch.Generator().manual_seed(0)
    rows, width = 2048, 1024
    live = (torch.arange(width) % 512 != 0) & (torch.rand(width, generator=g) < 0.5)
    x = (torch.randn(rows, 1, generator=g) * torch.randn(1, width, generator=g) * live).reshape(-1)
    sizes: list[int] = []
    real = torch.topk
    monkeypatch.setattr(torch, "topk", lambda t, *a, **kw: (sizes.append(t.numel()), real(t, *a, **kw))[1])
    vals, idx = dm.topk(x, 2048)
    assert torch.equal(idx.sort().values, real(x.abs(), 2048).indices.sort().values)
    assert sizes and max(sizes) < x.numel() // 100, sizes


def test_randk_indices_stay_uniform():
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(1000)
    for _ in range(400):
        hits[dm.randk_indices(1000, 10, g)] += 1
    assert hits.sum() == 4000 and hits.max() <= 14      # about 4 each: no index favoured


@pytest.mark.parametrize("compressor", ["topk", "randk", "quantize"])
def test_error_feedback_memory_keeps_exactly_what_was_not_sent(fake_world, compressor):
    fake_world(2)
    state = dm.ModeState(DataMode("compressed", compressor=compressor, ratio=0.25), n=2, rank=0,
                         group_name=dist.group.WORLD.group_name)
    g = torch.Generator().manual_seed(0)
    carried = torch.zeros(40, dtype=torch.float64)
    for _ in range(3):
        buf = torch.randn(40, generator=g, dtype=torch.float64)
        state.finish(state.issue(0, buf.clone()))     # the fake group answers at once
        memory, p = state.memory[0], buf + carried      # p: the gradient with the carried residual
        sent = p - memory                                  # what the memory says was sent
        if compressor == "quantize":    # whole multiples of max |p| / levels, at most levels of them
            steps = sent / (p.abs().max().float().double() / 5)    # one chunk of 40; its scale is fp32
            torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-9)
            assert steps.abs().max() <= 5 and (steps.round() != 0).any()
        else:                           # exactly k = 25 % of 40 entries, p's own values there
            kept = sent != 0
            assert int(kept.sum()) == 10 and torch.equal(sent[kept], p[kept])
            if compressor == "topk":
                assert p[kept].abs().min() >= p[~kept].abs().max()
        carried = memory.clone()          # the next exchange adds into the residual's buffer


def test_a_quantized_bucket_is_rounded_and_sent_when_the_next_one_comes(fake_world):
    """``issue`` only starts a bucket's scales; its levels are rounded and sent when the next
    bucket is issued (or its result is wanted), in the order the buckets came, and each result is
    what rounding the bucket at once would give."""
    fake_world(2)
    state = dm.ModeState(DataMode("compressed", compressor="quantize", levels=5), n=2, rank=0,
                         group_name=dist.group.WORLD.group_name)
    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(700, dtype=torch.float64)
    ha = state.issue(0, a.clone())
    assert state.unsent == [ha[1]] and 0 not in state.memory
    hb = state.issue(1, b.clone())
    assert state.unsent == [hb[1]] and 0 in state.memory and ha[1].levels is not None
    got = [state.finish(ha), state.finish(hb)]
    assert not state.unsent and 1 in state.memory

    def at_once(x: torch.Tensor, bucket: int) -> torch.Tensor:      # the fake group's sum is the rank's own
        gen = torch.Generator().manual_seed((state.mode.seed * 1_000_003 + bucket) * 1_000_003)
        maxima = dm.chunk_maxima(x)
        return dm.dequantize(dm.quantize(x, maxima, 5, gen), maxima, 5, x.dtype)
    assert torch.equal(got[0], at_once(a, 0)) and torch.equal(got[1], at_once(b, 1))
    assert torch.equal(state.memory[0], a - got[0])


@pytest.mark.parametrize("topology", ["ring", "grid", "exponential", "full"])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 9, 16])
def test_every_topology_mixes_with_a_symmetric_doubly_stochastic_matrix(topology, n):
    w = dm.mixing_matrix(topology, n)
    torch.testing.assert_close(w, w.T)
    torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(w.sum(1), torch.ones(n, dtype=torch.float64))
    # connected: repeated mixing reaches the average
    torch.testing.assert_close(torch.linalg.matrix_power(w, 2000), torch.full((n, n), 1.0 / n, dtype=torch.float64))


def test_neighbourhoods():
    assert dm.neighbours("ring", 8, 0) == [1, 7]
    assert dm.neighbours("exponential", 8, 0) == [1, 2, 4, 6, 7]
    assert dm.grid_shape(16) == (4, 4) and dm.neighbours("grid", 16, 5) == [1, 4, 6, 9]
    assert dm.neighbours("ring", 2, 1) == [0] and dm.neighbours("full", 4, 2) == [0, 1, 3]


def test_mode_options_are_checked():
    assert data_mode(None).kind == "allreduce"
    assert data_mode({"kind": "local_sgd", "sync_every": 4}) == DataMode("local_sgd", sync_every=4)
    assert DataMode("gossip").to_dict() == {"kind": "gossip", "topology": "ring", "global_every": 0}
    with pytest.raises(ConfigError, match="did you mean 'gossip'"):
        data_mode("gosip")
    with pytest.raises(ConfigError, match="(?s)sync_every do not apply to dp_mode 'gossip'.*local_sgd"):
        DataMode("gossip", sync_every=3)
    with pytest.raises(ConfigError, match="ratio must be a fraction"):
        DataMode("compressed", ratio=0.0)
    with pytest.raises(ConfigError, match="unknown dp_mode option 'sync'"):
        data_mode({"kind": "local_sgd", "sync": 2})
    with pytest.raises(ConfigError, match="needs its kind"):
        data_mode({"sync_every": 2})


def test_a_plan_file_carries_its_mode_and_refuses_a_bad_one():
    plan = Plan(mesh={"dp": 2}, tp_axis=None, params={}, nodes={}, dp_axis="dp", dp_mode={"kind": "local_sgd", "sync_every": 8, "warmup": 0})
    again = Plan.from_json(plan.to_json())
    assert again.dp_mode == plan.dp_mode and again.summary()["dp_mode"] == "local_sgd"
    text = plan.to_json().replace('"sync_every": 8', '"sync_every": 0')
    with pytest.raises(PlanFileError, match="sync_every"):
        Plan.from_json(text)


def _x() -> torch.Tensor:
    return torch.randn(2, 4)


@pytest.mark.parametrize("mesh, options, message", [
    ({"dp": 2}, dict(dp_mode="gossip", zero_stage=3), "needs zero_stage=0"),
    ({"dp": 2}, dict(dp_mode={"kind": "async"}, mixed_precision="fp16"), "fp16 loss scaling"),
    ({"pp": 2}, dict(dp_mode="gossip"), "does not compose with a pipeline"),
    ({"dp": 2, "ep": 2}, dict(dp_mode="compressed"), "does not compose with expert parallelism"),
    ({"dp": 2}, dict(dp_mode="local_sgd_"), "did you mean 'local_sgd'"),
])
def test_modes_that_do_not_compose_are_refused_before_any_collective(mesh, options, message):
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=message):
        autopar.parallelize(nn.Linear(4, 4), mesh, (_x(),), **options)
