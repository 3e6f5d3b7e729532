"""The capture cache: what its key sees, that an entry rebuilds the same graph, and that a bad
entry is a miss, never a wrong graph or code run."""
from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import logging
import os
import sys
import threading
import zlib

import pytest
import torch
from torch import nn

from autopar import analyze, capture
from autopar.passes import capture_cache
from autopar.passes.capture_cache import CaptureCache, _signature, decode, encode
from autopar.passes.capture_key import capture_key
from autopar.core.meta import graph_info, info
from tests.conftest import TOKEN_DIMS, small
from tests.hf_tiny import build as hf_build


def _tokens(b=2, s=8, vocab=64):
    return torch.randint(0, vocab, (b, s))


def _key(model, args, kwargs=None, dims=TOKEN_DIMS):
    return capture_key(model, args, kwargs or {}, [dict(d) for d in dims] if dims else None, None)


# ---- round trip ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["gpt symbolic", "gpt static", "hf llama", "hf gemma2 tied", "moe"])
def test_an_entry_rebuilds_the_captured_graph_and_its_analysis(case):
    if case.startswith("hf"):
        m = hf_build(case.split()[1])
        args, kw, dims = (_tokens(),), {"labels": _tokens()}, {"input_ids": {0: "batch", 1: "seq"},
                                                               "labels": {0: "batch", 1: "seq"}}
    else:
        m = small("moe" if case == "moe" else "gpt", layers=2, vocab=64)
        args, kw, dims = (_tokens(),), None, (None if case == "gpt static" else TOKEN_DIMS)
    gm = capture(m, args, kwargs=kw, dims=dims, cache=None)
    back = decode(encode(gm, "k"), "k")
    assert _signature(back) == _signature(gm)
    a, b = analyze(gm), analyze(back)
    rows = [[(n.name, info(n).values, info(n).flops_fwd, info(n).flops_bwd, info(n).saved_bytes, info(n).block_class,
              info(n).moe_role) for n in g.graph.nodes] for g in (a, b)]
    assert rows[0] == rows[1]
    assert [c.members for c in graph_info(a).block_classes] == [c.members for c in graph_info(b).block_classes]
    assert len(graph_info(a).block_classes) >= 1
    if case == "moe":
        assert graph_info(b).moe_regions and graph_info(b).moe_regions == graph_info(a).moe_regions


def test_a_rebuilt_graph_computes_what_the_model_computes():
    m = small("gpt", layers=2, vocab=64).double()
    x = _tokens()
    gm = capture(m, (x,), dims=TOKEN_DIMS, cache=None)
    back = decode(encode(gm, "k"), "k")
    g = graph_info(back)
    state = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    inputs = [state[g.param_fqns[n.name]] if n.name in g.param_fqns else
              state[g.buffer_fqns[n.name]] if n.name in g.buffer_fqns else x
              for n in back.graph.nodes if n.op == "placeholder"]
    out = back(*inputs)
    ref = m(x)
    got = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---- the key ---------------------------------------------------------------------------

class Scaled(nn.Module):
    def __init__(self, scale=2.0, act=torch.tanh) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x)) * self.scale


def test_the_key_sees_what_changes_the_graph_and_ignores_weights_and_input_values():
    x = torch.randn(4, 8)
    dims = ({0: "batch"},)
    base = _key(Scaled(), (x,), dims=dims)
    assert base is not None
    assert _key(Scaled(), (torch.randn(4, 8),), dims=dims) == base           # other weights, other values
    changed = {
        "attribute": _key(Scaled(scale=3.0), (x,), dims=dims),
        "function attribute": _key(Scaled(act=torch.sigmoid), (x,), dims=dims),
        "lambda closure": _key(Scaled(act=lambda t, k=1: t * k), (x,), dims=dims),
        "input shape": _key(Scaled(), (torch.randn(5, 8),), dims=dims),
        "input dtype": _key(Scaled().double(), (x.double(),), dims=dims),
        "labels": _key(Scaled(), (x,), dims=({},)),
        "eval mode": _key(Scaled().eval(), (x,), dims=dims),
        "frozen weight": _key(_frozen(Scaled()), (x,), dims=dims),
        "hook": _key(_hooked(Scaled()), (x,), dims=dims),
    }
    assert all(k is not None and k != base for k in changed.values()), changed
    assert _key(Scaled(act=lambda t, k=1: t * k), (x,), dims=dims) != _key(Scaled(act=lambda t, k=2: t * k), (x,),
                                                                            dims=dims)


def _frozen(m):
    m.lin.bias.requires_grad_(False)
    return m


def _hooked(m):
    m.lin.register_forward_hook(lambda mod, inp, out: out * 2)
    return m


def test_the_key_follows_the_model_source_file(tmp_path, monkeypatch):
    src = tmp_path / "user_model_for_key.py"
    body = "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n" \
           "        self.lin = torch.nn.Linear(4, 4)\n    def forward(self, x):\n        return {}\n"
    keys = []
    for i, expr in enumerate(["self.lin(x)", "self.lin(x).relu() + 1"]):
        src.write_text(body.format(expr))
        spec = importlib.util.spec_from_file_location("user_model_for_key", src)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "user_model_for_key", mod)
        spec.loader.exec_module(mod)
        keys.append(_key(mod.M(), (torch.randn(2, 4),), dims=None))
    assert None not in keys and keys[0] != keys[1]


class Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lock = threading.Lock()          # nothing the key can describe

    def forward(self, x):
        return self.lin(x)


def test_an_unkeyable_model_is_captured_without_the_cache(tmp_path):
    m, x = Locked(), torch.randn(2, 4)
    assert _key(m, (x,), dims=None) is None
    gm = capture(m, (x,), cache=CaptureCache(tmp_path))
    assert len(graph_info(gm).param_fqns) == 2
    assert not list(tmp_path.iterdir())


# ---- disk --------------------------------------------------------------------------------

def _fresh(tmp_path):
    """A cache on tmp_path with an empty memory: what a new process sees."""
    capture_cache._memory.clear()
    capture_cache._secrets.clear()
    return CaptureCache(tmp_path)


def test_a_second_process_reads_the_graph_from_disk(tmp_path, caplog):
    m, x = small("gpt", layers=2, vocab=64), _tokens()
    first = capture(m, (x,), dims=TOKEN_DIMS, cache=_fresh(tmp_path))
    assert len(list(tmp_path.glob("capture-*.json.z"))) == 1
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        again = capture(m, (x,), dims=TOKEN_DIMS, cache=_fresh(tmp_path))
    assert "from the cache (disk)" in caplog.text
    assert _signature(again) == _signature(first)


def _rewrite(path, edit, signed=None):
    """Edit an entry's description and sign it again: with ``signed`` (None: a bare SHA-256, as
    anyone could recompute it)."""
    head, _, packed = path.read_bytes().partition(b"\n")
    body = json.loads(zlib.decompress(packed))
    edit(body)
    packed = zlib.compress(json.dumps(body).encode())
    if signed is None:
        path.write_bytes(hashlib.sha256(packed).hexdigest().encode() + b"\n" + packed)
    else:
        path.write_bytes(b"hmac-sha256 " + hmac.new(signed, packed, hashlib.sha256).hexdigest().encode()
                         + b"\n" + packed)


MARK = "autopar-cache-attack-ran"


def _operator_chain(body):
    """The chain a crafted entry could build from operator's getters and callers: getattr of
    ``os`` from a module object's globals, then ``system``, then a call; each a node target."""
    node = next(n for n in body["nodes"] if n[1] == "call_function")
    node[2] = ["py", "operator", "methodcaller"]
    node[3] = {"T": ["system", f"touch {MARK}"]}


def _call_os_system(body):
    node = next(n for n in body["nodes"] if n[1] == "call_function")
    node[2] = ["py", "os", "system"]


def _other_key(body):
    body["key"] = "0" * 64


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "target outside torch.ops", "foreign key",
                                    "operator chain, re-hashed", "operator chain, signed with our key",
                                    "signed with another key"])
def test_a_damaged_or_crafted_entry_is_a_miss_and_the_capture_is_redone(tmp_path, caplog, damage, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, x = small("gpt", layers=1, vocab=64), _tokens()
    cache = _fresh(tmp_path)
    ref = capture(m, (x,), dims=TOKEN_DIMS, cache=cache)
    path, = tmp_path.glob("capture-*.json.z")
    raw = path.read_bytes()
    ours = capture_cache.secret(cache)
    if damage == "flipped byte":
        path.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "operator chain, re-hashed":
        _rewrite(path, _operator_chain)
    elif damage == "operator chain, signed with our key":      # even with the key: outside the vocabulary
        _rewrite(path, _operator_chain, ours)
    elif damage == "signed with another key":
        _rewrite(path, lambda body: None, os.urandom(32))
    else:
        _rewrite(path, _call_os_system if damage == "target outside torch.ops" else _other_key, ours)
    with caplog.at_level(logging.INFO, logger="autopar.capture"):
        again = capture(m, (x,), dims=TOKEN_DIMS, cache=_fresh(tmp_path))
    assert "is unusable" in caplog.text and "from the cache" not in caplog.text
    assert _signature(again) == _signature(ref)
    assert not (tmp_path / MARK).exists()


def test_a_crafted_target_is_refused_before_any_node_is_built():
    gm = capture(small("gpt", layers=1, vocab=64), (_tokens(),), dims=TOKEN_DIMS, cache=None)
    blob = encode(gm, "k")
    head, _, packed = blob.partition(b"\n")
    body = json.loads(zlib.decompress(packed))
    for target in (["py", "operator", "attrgetter"], ["py", "operator", "call"], ["py", "builtins", "eval"],
                   ["op", "aten", "__class__", "__subclasses__"], "os.system"):
        _operator_chain(body)
        next(n for n in body["nodes"] if n[1] == "call_function")[2] = target
        packed = zlib.compress(json.dumps(body).encode())
        signed = b"hmac-sha256 " + hmac.new(capture_cache._PROCESS_SECRET, packed, hashlib.sha256).hexdigest().encode()
        with pytest.raises(ValueError, match="outside the cache's vocabulary|is not an operator"):
            decode(signed + b"\n" + packed, "k")


def test_the_signing_key_is_private_and_a_shared_one_is_not_trusted(tmp_path, caplog):
    m, x = small("gpt", layers=1, vocab=64), _tokens()
    capture(m, (x,), dims=TOKEN_DIMS, cache=_fresh(tmp_path))
    key = capture_cache.key_path(tmp_path)
    assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600
    other = tmp_path / "loose"
    other.mkdir()
    capture_cache.key_path(other).write_text("ab" * 32)
    capture_cache.key_path(other).chmod(0o644)          # readable by everyone: anyone could sign with it
    with caplog.at_level(logging.WARNING, logger="autopar.capture"):
        capture(m, (x,), dims=TOKEN_DIMS, cache=_fresh(other))
    assert "cannot be used" in caplog.text and "mode 644" in caplog.text
    assert not list(other.glob("capture-*.json.z"))     # nothing written or read under an untrusted key


def test_the_directory_is_kept_under_its_size_limit(tmp_path):
    cache = CaptureCache(tmp_path, max_bytes=1)
    for layers in (1, 2):
        capture(small("gpt", layers=layers, vocab=64), (_tokens(),), dims=TOKEN_DIMS, cache=cache)
    assert len(list(tmp_path.glob("capture-*.json.z"))) <= 1


def test_the_key_follows_code_redefined_in_a_module_without_a_file(monkeypatch):
    """A notebook's cells redefine a model class in ``__main__``, which has no file to hash."""
    import types
    mod = types.ModuleType("notebook_like")
    monkeypatch.setitem(sys.modules, "notebook_like", mod)
    keys = []
    for expr in ("self.lin(x)", "self.lin(x) * 2"):
        exec("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             f"        self.lin = torch.nn.Linear(4, 4)\n    def forward(self, x):\n        return {expr}\n",
             mod.__dict__)
        mod.M.__module__ = "notebook_like"
        keys.append(_key(mod.M(), (torch.randn(2, 4),), dims=None))
    assert None not in keys and keys[0] != keys[1]
