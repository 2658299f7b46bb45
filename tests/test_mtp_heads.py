"""MTP heads verified by the target: tree construction and verification rules on hand-made
inputs, and greedy identity with autoregressive decoding (chain and trees) on tiny models, with
scripted heads that are sometimes wrong."""

import pytest
import torch
from conftest import TINY_CONFIGS, OracleHeads, decode, tiny_model

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.sampling import verify_greedy, verify_tree_greedy, verify_tree_sampling, verify_tree_typical
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.mtp_heads import DEFAULT_TREE, LARGE_TREE, MTPHeadsSettings, parse_tree
from mtp_viz.trace import ACCEPTED, VERDICT_ACCEPTED, VERDICT_REJECTED
from mtp_viz.visibility import node_depths, tree_visibility

PROMPT = [5, 17, 3, 42, 9, 17, 3]
TREES = ["chain", DEFAULT_TREE, LARGE_TREE, "0,1,2,3,00,10,20,30,000,100"]


def test_parse_tree_orders_and_validates():
    assert parse_tree("00,1,0,000") == [(0,), (1,), (0, 0), (0, 0, 0)]
    assert parse_tree("chain", 3) == [(0,), (0, 0), (0, 0, 0)]
    for bad in ("0,01x", "", "00", "0,,1"):
        with pytest.raises(InvalidSettingsError):
            MTPHeadsSettings(tree=bad)
    with pytest.raises(InvalidSettingsError):
        MTPHeadsSettings(acceptance="loose")


def test_tree_mask_sees_only_ancestors():
    #        root
    #       /    \\
    #      0      1
    #     / \\
    #    2   3
    #    |
    #    4
    parents = [-1, -1, 0, 0, 2]
    assert node_depths(parents) == [1, 1, 2, 2, 3]
    seen = tree_visibility(parents)
    assert seen[4].tolist() == [True, False, True, False, True]
    assert seen[3].tolist() == [True, False, False, True, False]
    assert seen[1].tolist() == [False, True, False, False, False]


def test_greedy_tree_follows_the_target_down_a_non_first_branch():
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 1, 1, 3]
    # the target wants 11 at the root, then 13 after it, then 14, then 99
    argmax = [11, 0, 13, 0, 14, 99]  # rows: root, then per node
    v = verify_tree_greedy(argmax, tokens, parents)
    assert v.path == [1, 3, 4] and v.next_token == 99 and v.next_origin == "bonus"
    assert sorted(v.rejected) == [0, 2]


def test_greedy_tree_on_a_chain_is_the_chain_rule():
    for draft, target in (([1, 2, 3], [1, 2, 3, 4]), ([1, 5, 3], [1, 2, 3, 4]), ([7], [1, 2])):
        chain = verify_greedy(target, draft)
        tree = verify_tree_greedy(target, draft, [-1] + list(range(len(draft) - 1)))
        assert (len(tree.path), tree.next_token, tree.next_origin) == (
            chain.accepted,
            chain.next_token,
            chain.next_origin,
        )


def _exact_first_tokens(p_target, tokens, parents, draws=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_target.shape[1])
    for _ in range(draws):
        v = verify_tree_sampling(p_target, tokens, parents, g)
        first = tokens[v.path[0]] if v.path else v.next_token
        counts[first] += 1
    return counts / draws


def test_tree_sampling_emits_the_target_distribution():
    """First token of a step ~ p at the root, whatever the candidates (two siblings here)."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4, [0.1, 0.2, 0.3, 0.4]])
    freq = _exact_first_tokens(p, tokens=[1, 0], parents=[-1, -1])
    torch.testing.assert_close(freq, p[0], atol=0.012, rtol=0)
    # Negative control: accepting siblings with the untouched p (no residual) is biased.
    import mtp_viz.sampling as sampling

    original = sampling.residual_distribution
    sampling.residual_distribution = lambda p, q: p
    try:
        biased = _exact_first_tokens(p, tokens=[1, 0], parents=[-1, -1])
    finally:
        sampling.residual_distribution = original
    assert (biased - p[0]).abs().max() > 0.05


def test_typical_acceptance_takes_the_longest_passing_path():
    p = torch.tensor([[0.6, 0.35, 0.05], [0.05, 0.9, 0.05], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    tokens, parents = [0, 1, 1], [-1, -1, 0]  # 0 and 1 at the root; under 0: token 1
    v = verify_tree_typical(p, tokens, parents, epsilon=0.09, delta=0.3)
    assert v.path == [0, 2] and v.next_token == 2  # node 1 passes too, but its path is shorter


def _heads_cases():
    for name in TINY_CONFIGS:
        for seed in (0, 1):
            yield name, seed


@pytest.mark.parametrize("name,seed", list(_heads_cases()))
def test_greedy_identical_to_autoregressive_chain_and_trees(name, seed):
    model = tiny_model(name, seed=seed)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    heads = OracleHeads(model, PROMPT, reference)
    non_first_branch_won = False
    for tree in TREES:
        out, steps = decode(model, "mtp_heads", PROMPT, generation, heads=heads, tree=tree, num_guesses=4)
        assert out == reference, tree
        verdicts = [v for s in steps for v in s.verdicts]
        assert VERDICT_ACCEPTED in verdicts and VERDICT_REJECTED in verdicts, tree
        assert sum(len(s.emitted) for s in steps) / len(steps) > 1.5  # the guesses mostly pay
        for s in steps:
            path = s.extra["accepted_path"]
            non_first_branch_won |= any(any(rank > 0 for rank in s.extra["tree"][node]) for node in path)
            assert [e.origin for e in s.emitted[: len(path)]] == [ACCEPTED] * len(path)
            assert s.kv_len == len(PROMPT) + sum(len(x.emitted) for x in steps[: s.index + 1]) - 1
    assert non_first_branch_won


@pytest.mark.parametrize("tree", TREES[:2])
def test_eos_and_budget_inside_a_tree(tree):
    model = tiny_model("llama-2l", seed=0)
    free_run, _ = decode(model, "autoregressive", PROMPT, GenerationSettings(max_new_tokens=40))
    heads = OracleHeads(model, PROMPT, free_run, wrong_every=5)
    position = next(i for i in range(8, len(free_run)) if free_run[i] not in free_run[:i])
    eos = free_run[position]
    out, _ = decode(
        model, "mtp_heads", PROMPT, GenerationSettings(max_new_tokens=40), heads=heads, eos=[eos], tree=tree
    )
    assert out == free_run[: position + 1]
    for budget in (1, 2, 7, 13):
        g = GenerationSettings(max_new_tokens=budget)
        out, steps = decode(model, "mtp_heads", PROMPT, g, heads=heads, tree=tree)
        assert out == free_run[:budget]
        assert all(max(s.depths, default=0) <= budget for s in steps)
