"""Lookahead decoding's parts on hand-made inputs: the n-gram pool, the candidate trie, the window's
positions and attention (checked against plain forwards), and n-gram harvesting."""

import torch
from conftest import decode, tiny_model

from mtp_viz.cache import CachedModel
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.lookahead import JACOBI, NGramPool, harvest, trie, window_layout
from mtp_viz.visibility import node_depths, tree_visibility


def test_pool_keeps_the_latest_g_per_key():
    pool = NGramPool(capacity=2)
    pool.add(1, (2, 3), JACOBI)
    pool.add(1, (4, 5), JACOBI)
    pool.add(1, (2, 3), JACOBI)  # seen again: most recent now
    pool.add(1, (6, 7), JACOBI)  # evicts the oldest, (4, 5)
    assert [g for g, _ in pool.candidates(1)] == [(2, 3), (6, 7)]
    assert pool.candidates(9) == [] and len(pool) == 2


def test_trie_merges_shared_prefixes_and_cuts_depth():
    tokens, parents, origins = trie([((5, 6, 7), "jacobi"), ((5, 6, 8), "prompt"), ((9, 1, 2), "jacobi")], depth=2)
    assert tokens == [5, 6, 9, 1] and parents == [-1, 0, -1, 2]
    assert origins == ["jacobi", "jacobi", "jacobi", "jacobi"]
    tokens, parents, _ = trie([((5, 6, 7), "jacobi"), ((5, 6, 8), "prompt")], depth=3)
    assert tokens == [5, 6, 7, 8] and parents == [-1, 0, 1, 1]


def test_window_layout_positions_and_visibility():
    slots, offsets, seen = window_layout(levels=2, width=3)
    assert slots == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert offsets == [1, 2, 1, 2, 3]
    # level-1 column 1 sees level-0 column 1 and itself, nothing else
    assert seen[3].tolist() == [True, False, False, True, False]
    # level-1 column 0 sees only itself (its level-0 token is cur)
    assert seen[2].tolist() == [False, False, True, False, False]


def test_harvest_takes_one_ngram_per_column():
    pool = NGramPool(capacity=4)
    harvest(pool, cur=10, window=[[11, 12], [20, 21, 22]], new=[30, 31, 32])
    assert pool.candidates(10) == [((20, 30), JACOBI)]
    assert pool.candidates(11) == [((21, 31), JACOBI)]
    assert pool.candidates(12) == [((22, 32), JACOBI)]


def test_window_and_tree_outputs_equal_plain_forwards_of_their_prefixes():
    """Every extra token's logits are the model's logits after the prefix its mask lets it see."""
    model = tiny_model("llama-3l-mha", seed=0)
    prefix = [5, 17, 3, 42, 9]
    window = [[7, 8], [11, 12, 13], [21, 22, 23]]  # 3 levels, width 3
    slots, offsets, seen = window_layout(3, 3)
    tree_tokens, parents = [40, 41, 42], [-1, 0, -1]
    cached = CachedModel(model)
    cached.forward(prefix[:-1])
    extra = [t for level in window for t in level] + tree_tokens
    visibility = torch.block_diag(seen, tree_visibility(parents))
    logits, _ = cached.forward_hidden(prefix, extra, offsets + node_depths(parents), visibility)
    row0 = [prefix[-1]] + window[0]

    def plain(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1]

    for i, (level, column) in enumerate(slots):
        seen_prefix = prefix + row0[1 : column + 1] + [window[lv][column] for lv in range(1, level + 1)]
        torch.testing.assert_close(logits[1 + i], plain(seen_prefix), atol=1e-4, rtol=1e-4)
    n = len(slots)
    torch.testing.assert_close(logits[1 + n + 1], plain(prefix + [40, 41]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1 + n + 2], plain(prefix + [42]), atol=1e-4, rtol=1e-4)


def test_pool_hits_are_recorded_by_origin():
    model = tiny_model("llama-2l", seed=0)
    prompt = [5, 17, 3, 42, 9, 17, 3]
    generation = GenerationSettings(max_new_tokens=40)
    _, steps = decode(model, "lookahead", prompt, generation, level=5, window=7, guess=7, pool_from_prompt=True)
    sources = {d.source for s in steps for d in s.drafted}
    assert sources <= {"jacobi", "prompt"} and sources
    assert all(s.extra["hits"] <= 7 and len(s.extra["window"]) == 4 for s in steps)
