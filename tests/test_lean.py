"""The lean forward (mtp_viz.lean) computes what transformers' forward computes, over a cache that
extends in place and rolls back without copies; unsupported models fall back to transformers."""

import pytest
import torch
from conftest import TINY_CONFIGS, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel

from mtp_viz.cache import ENGINE_ENV, LEAN, TRANSFORMERS, CachedModel, engine_for, tree_visibility
from mtp_viz.lean import lean_model, supports

IDS = [5, 17, 3, 42, 9, 17, 3, 8, 9, 10, 11, 12]


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_chain_logits_equal_transformers_forward(name):
    model = tiny_model(name)
    with torch.no_grad():
        reference = model(torch.tensor([IDS])).logits[0]  # (L, V)
    cached = CachedModel(model)
    assert cached.engine == LEAN
    got = [cached.forward(IDS[:7], logits_to_keep=7)]
    got.append(cached.forward(IDS[:8]))  # one token
    got.append(cached.forward(IDS, logits_to_keep=4))  # a block after a past
    torch.testing.assert_close(torch.cat(got), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tree_rows_equal_each_path_run_alone(name):
    """A token tree in one forward: each node's logits are those of its own path as a plain sequence."""
    model = tiny_model(name)
    prefix = IDS[:6]
    tokens, parents = [7, 8, 9, 10], [-1, -1, 0, 2]  # two children of the root; a chain under the first
    depths = [1, 1, 2, 3]
    cached = CachedModel(model)
    logits, hidden = cached.forward_hidden(prefix, tokens, depths, tree_visibility(parents))
    assert logits.shape[0] == hidden.shape[0] == 1 + len(tokens)
    paths = [[7], [8], [7, 9], [7, 9, 10]]
    with torch.no_grad():
        for row, path in enumerate(paths, start=1):
            alone = model(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(logits[row], alone, rtol=1e-4, atol=1e-5)


def test_keep_moves_the_accepted_path_and_rollback_copies_nothing():
    model = tiny_model("llama-2l")
    cached = CachedModel(model)
    prefix = IDS[:6]
    cached.forward_hidden(prefix, [7, 8, 9], [1, 1, 2], tree_visibility([-1, -1, 1]))
    cached.keep(len(prefix), [1, 2])  # keep the path 8 → 9
    data = cached.backend.kv.data
    cached.rollback(len(prefix) + 1)
    assert cached.backend.kv.data is data  # rollback is a length
    after = cached.forward(prefix + [8, 9, 4])
    fresh = CachedModel(model).forward(prefix + [8, 9, 4])
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-5)


def test_the_cache_grows_by_doubling_and_keeps_its_entries():
    model = tiny_model("llama-2l")
    cached = CachedModel(model)
    seq = list(range(10, 20))
    cached.forward(seq)
    first = cached.backend.kv.capacity
    long = seq + [(i * 7) % 90 + 3 for i in range(first + 5)]
    logits = cached.forward(long)
    assert cached.backend.kv.capacity == 2 * first
    torch.testing.assert_close(logits, CachedModel(model).forward(long), rtol=1e-4, atol=1e-5)


def test_fused_projections_are_views_and_leave_the_weights_alone():
    model = tiny_model("qwen2-2l")  # q/k/v carry biases
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lean = lean_model(model)
    assert all(f is not None for f in lean.fused)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == lean.fused[0].qkv.data_ptr()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    model.to(torch.float64)  # weights replaced: the lean view is rebuilt, not stale
    assert lean_model(model) is not lean and lean_model(model).current()


def test_unsupported_models_run_on_transformers_forward(monkeypatch):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    gpt2 = GPT2LMHeadModel(config).eval()
    assert supports(gpt2) and lean_model(gpt2) is None
    assert engine_for(gpt2) == TRANSFORMERS
    cached = CachedModel(gpt2)
    with torch.no_grad():
        reference = gpt2(torch.tensor([IDS])).logits[0, -1]
    cached.forward(IDS[:5])
    torch.testing.assert_close(cached.forward(IDS)[0], reference, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv(ENGINE_ENV, TRANSFORMERS)  # and any model can be sent there
    assert engine_for(tiny_model("llama-2l")) == TRANSFORMERS
