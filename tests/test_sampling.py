"""The accept/resample rule preserves the target distribution exactly; warping matches transformers."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from mtp_viz.sampling import (
    Verdict,
    Warp,
    acceptance_probability,
    chain_as_tree,
    probs_from_logits,
    residual_distribution,
    verify_greedy,
    verify_sampling,
    verify_tree_greedy,
)


def _random_dist(v: int, seed: int, sparsity: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(v, generator=g, dtype=torch.float64) ** 3
    x[torch.rand(v, generator=g) < sparsity] = 0.0
    x[0] += 1e-3  # never all zero
    return x / x.sum()


def output_distribution(p_target, q_draft, accept=acceptance_probability, residual=residual_distribution):
    """Exact distribution of the emitted token: draft x ~ q, keep it with a(x), else draw from r."""
    a = accept(p_target, q_draft)  # (V,)
    kept = q_draft * a
    rejected_mass = (q_draft * (1 - a)).sum()
    return kept + rejected_mass * residual(p_target, q_draft)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_accept_resample_rule_yields_p_exactly(seed, sparsity):
    p = _random_dist(50, seed, sparsity)
    q = _random_dist(50, seed + 1000, sparsity)
    q = torch.where(q > 0, q, 0.0)
    torch.testing.assert_close(output_distribution(p, q), p, atol=1e-12, rtol=0)


def test_rule_yields_p_for_hand_made_cases():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    for q in ([0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0], [0.5, 0.3, 0.2, 0.0], [1.0, 0.0, 0.0, 0.0]):
        q = torch.tensor(q, dtype=torch.float64)
        torch.testing.assert_close(output_distribution(p, q), p, atol=1e-12, rtol=0)


def test_exactness_check_catches_wrong_rules():
    """The identity above has power: plausible-looking mistakes break it."""
    p = _random_dist(20, 1)
    q = _random_dist(20, 2)
    wrong_residual = lambda p, q: p  # noqa: E731 - resample from p instead of norm(max(0, p-q))
    wrong_accept = lambda p, q: torch.clamp(q / p, max=1)  # noqa: E731 - ratio upside down
    for kwargs in ({"residual": wrong_residual}, {"accept": wrong_accept}):
        assert (output_distribution(p, q, **kwargs) - p).abs().max() > 1e-3


def test_verify_sampling_monte_carlo_first_token_matches_p():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    n = 20_000
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        v = verify_sampling(p, q, [draft], g)
        counts[draft if v.accepted else v.next_token] += 1
    torch.testing.assert_close(counts / n, p[0], atol=0.015, rtol=0)


def test_verify_sampling_bonus_after_full_acceptance():
    p = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    q = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    v = verify_sampling(p, q, [1, 1], torch.Generator().manual_seed(0))
    assert (v.accepted, v.next_token, v.next_origin) == (2, 0, "bonus")


def test_verify_greedy_cases():
    # greedy verification draws nothing: one None per verified position
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == Verdict(3, 7, "bonus", [None, None, None])
    assert verify_greedy([4, 5, 6, 7], [9, 5, 6]) == Verdict(0, 4, "resampled", [None])
    assert verify_greedy([4, 5, 6, 7], [4, 5, 9]) == Verdict(2, 6, "resampled", [None, None, None])
    assert verify_greedy([4], []) == Verdict(0, 4, "bonus", [])  # nothing drafted: the target's own token
    v = verify_greedy([4, 5, 6, 7], [4, 9, 6])
    assert (v.accepted, v.next_token, v.next_origin) == (1, 5, "resampled")
    v = verify_greedy([4, 5, 6, 7], [4, 5, 6])
    assert (v.accepted, v.next_token, v.next_origin) == (3, 7, "bonus")
    v = verify_greedy([8, 5], [4])
    assert (v.accepted, v.next_token) == (0, 8)


def test_residual_falls_back_to_p_when_p_equals_q():
    p = torch.tensor([0.5, 0.5])
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5), (2.0, 3, 0.95), (1.0, 0, 0.01)],
)
def test_warping_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)) * 3
    ours = probs_from_logits(logits, Warp(temperature, top_k, top_p))
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(ours, torch.softmax(ref, -1), atol=1e-6, rtol=0)


def test_greedy_warp_is_plain_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(probs_from_logits(logits, Warp()), torch.softmax(logits, -1))


@pytest.mark.parametrize("seed", range(20))
def test_a_chain_verdict_as_a_tree_is_the_tree_rules_verdict_on_the_chain(seed):
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(0, 5, (), generator=g))
    argmax = torch.randint(0, 3, (k + 1,), generator=g).tolist()  # 3 tokens: agreements are common
    draft = torch.randint(0, 3, (k,), generator=g).tolist()
    parents = list(range(-1, k - 1))
    assert chain_as_tree(verify_greedy(argmax, draft), k) == verify_tree_greedy(argmax, draft, parents)


def test_chain_as_tree_keeps_the_draws_and_the_rejection():
    tree = chain_as_tree(Verdict(1, 7, "resampled", [0.1, 0.95]), 3)
    assert (tree.path, tree.rejected, tree.draws, tree.next_token) == ([0], [1], {0: 0.1, 1: 0.95}, 7)
