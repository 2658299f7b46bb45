"""The compiled lean forward where a CPU can try it (inductor; CUDA graphs are scripts/gpu_check.sh's):
decoding past the KV cache's initial capacity, where the cache grows (doubling) and the compiled
forward meets a new width, and the strategies whose forwards carry a token tree (mtp_heads) or
mask tokens through a gated adapter (mask_spec). Each is token-identical to its eager run and is
still compiled at the end: a compiled forward that fails falls back to eager with a warning, which
would otherwise let a broken graph pass as identical."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from conftest import OracleHeads, decode, hf_greedy, perturbed, tiny_model
from optional import require
from test_mask_mtp import V, random_adapter

from mtp_viz import static
from mtp_viz.lean import MIN_CAPACITY, compile_unavailable, lean_model
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.mtp_heads import DEFAULT_TREE
from mtp_viz.trace import VERDICT_ACCEPTED, VERDICT_REJECTED
from mtp_viz.visibility import causal_after

pytestmark = pytest.mark.slow  # each model's forward compiles once: ~30 s on two cores
PROMPT = [5, 17, 3, 42, 9, 17, 3]
PAST_CAPACITY = GenerationSettings(max_new_tokens=MIN_CAPACITY + 16)  # prompt + output outgrow the cache


@contextmanager
def compiled(*models):
    """The models' lean forwards compiled for the block; asserts none fell back to eager in it."""
    require(compile_unavailable(torch.device("cpu")) is None, "a C++ compiler for inductor", "apt-get install g++")
    leans = [lean_model(m) for m in models]
    try:
        for lean in leans:
            lean.compile()
        yield
        assert all(lean.compiled for lean in leans), "a compiled forward failed and fell back to eager"
    finally:
        for lean in leans:
            lean.decompile()


def grew(steps) -> bool:
    """Whether the run's KV cache went past its initial capacity."""
    return max(s.kv_len for s in steps) > MIN_CAPACITY


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama-2l", seed=1)


@pytest.fixture(scope="module")
def reference(target):
    """Eager autoregressive greedy past the initial capacity, checked against transformers."""
    out, steps = decode(target, "autoregressive", PROMPT, PAST_CAPACITY)
    assert grew(steps) and out == hf_greedy(target, PROMPT, PAST_CAPACITY.max_new_tokens)
    return out


def test_compiled_decoding_across_kv_growth_is_identical(target, reference):
    draft = perturbed(target, noise=0.2, seed=11)
    with compiled(target, draft):
        ar, ar_steps = decode(target, "autoregressive", PROMPT, PAST_CAPACITY)
        spec, spec_steps = decode(target, "speculative", PROMPT, PAST_CAPACITY, draft=draft, num_draft_tokens=4)
    assert grew(ar_steps) and grew(spec_steps)
    assert ar == reference
    assert spec == reference
    assert any(s.accepted for s in spec_steps) and any(VERDICT_REJECTED in s.verdicts for s in spec_steps)


def test_mtp_heads_compiled_equals_eager(target, reference):
    heads = OracleHeads(target, PROMPT, reference)
    eager = {
        tree: decode(target, "mtp_heads", PROMPT, PAST_CAPACITY, heads=heads, tree=tree)
        for tree in ("chain", DEFAULT_TREE)
    }
    with compiled(target):
        runs = {tree: decode(target, "mtp_heads", PROMPT, PAST_CAPACITY, heads=heads, tree=tree) for tree in eager}
    for tree, (out, steps) in runs.items():
        assert out == eager[tree][0] == reference, tree
        assert grew(steps), tree
        verdicts = {v for s in steps for v in s.verdicts}
        assert {VERDICT_ACCEPTED, VERDICT_REJECTED} <= verdicts, tree  # the tree both pays and is cut


def test_mask_spec_compiled_equals_eager():
    peaked = tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)
    view = random_adapter(peaked)
    prompt = [3, 1, 5, 3, 1]
    ar, _ = decode(peaked, "autoregressive", prompt, PAST_CAPACITY)
    eager, _ = decode(view, "mask_spec", prompt, PAST_CAPACITY, mask_token_id=V, k=3)
    with compiled(view):
        out, steps = decode(view, "mask_spec", prompt, PAST_CAPACITY, mask_token_id=V, k=3)
    assert out == eager == ar
    assert grew(steps)
    assert any(s.accepted for s in steps)  # the masks' guesses were verified, not only drafted


@torch.no_grad()
def test_the_adapted_graph_adds_the_adapter_on_mask_rows_and_leaves_real_rows_bit_exact():
    """A forward carrying mask tokens runs the adapted graph (LoRA terms stacked on, gated): its real
    rows are the plain graph's bit for bit (a closed gate adds an exact zero), its mask rows what
    the eager forward computes with the adapter on (to rounding), and a mask_spec run goes through it."""
    peaked = tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)
    view = random_adapter(peaked)
    lean = lean_model(view)
    ids = torch.tensor([3, 1, 5, 3, V, V])

    def forward(tokens: torch.Tensor) -> torch.Tensor:  # a prefill, as CachedModel runs one: causal
        n = len(tokens)
        return lean.run(lean.embed(tokens), list(range(n)), lean.new_cache(), 0, causal_after(0, n))

    eager = forward(ids)
    with compiled(view):
        assert lean.static.adapted is not None and lean.static.adapted_ready()
        calls = []
        runner = lean.static.adapted.runner
        lean.static.adapted.runner = lambda *args: calls.append(len(args)) or runner(*args)
        masked, plain = forward(ids), forward(ids[:4])
        assert calls, "the forward with mask rows did not run the adapted graph"
        calls.clear()
        forward(ids[:4])
        assert not calls  # no mask token: the plain graph
        out, _ = decode(view, "mask_spec", [3, 1, 5, 3, 1], GenerationSettings(max_new_tokens=12), mask_token_id=V, k=3)
        assert calls
    assert torch.equal(masked[:4], plain)
    torch.testing.assert_close(masked[4:], eager[4:], rtol=1e-3, atol=1e-2)  # values in the hundreds
    lean.adapters_on = lambda: False  # the same forward without the LoRA terms: far from it
    try:
        assert not torch.allclose(masked[4:], forward(ids)[4:], atol=1e-2)
    finally:
        del lean.adapters_on


def test_the_layer_views_follow_each_new_cache_even_at_a_reused_id(monkeypatch):
    """The compiled forward keeps each layer's key/value views of the cache it last ran on. A run's
    new cache can be allocated where the last one's freed tensor was, at the same id(): views keyed
    by id read the old cache (a Spec-Bench run wrote garbage from its first token). Every id here is
    the same, as if always reused."""
    monkeypatch.setattr(static, "id", lambda obj: 0, raising=False)
    forward = static.StaticForward.__new__(static.StaticForward)
    forward.layers, forward._views = [None, None], None
    for i in range(3):
        kv = SimpleNamespace(data=torch.full((2, 2, 1, 4, 2), float(i)))
        keys, values = forward.views(kv)[1]
        assert keys.data_ptr() == kv.data[1, 0].data_ptr() and values.data_ptr() == kv.data[1, 1].data_ptr()
