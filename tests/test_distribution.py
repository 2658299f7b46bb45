"""Sampled output is distributed exactly as the target's: the empirical distribution of the first
tokens matches the distribution computed exactly from a tiny model with a small vocabulary."""

import itertools

import pytest
import torch
from conftest import decode, tiny_model

import mtp_viz.sampling as sampling
from mtp_viz.quality import goodness_of_fit, two_sample
from mtp_viz.sampling import probs_from_logits
from mtp_viz.strategies.base import GenerationSettings

V = 8
N_TOKENS = 2
SAMPLES = 3000
PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup drafts


def exact_joint(model, generation) -> dict[tuple[int, ...], float]:
    """P(first N tokens) by enumerating every sequence of the tiny vocabulary."""
    out = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        prob = 1.0
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(seq)])).logits[0, len(PROMPT) - 1 :]
        dists = probs_from_logits(logits, generation.warp)
        for i, t in enumerate(seq):
            prob *= float(dists[i, t])
        out[seq] = prob
    return out


def sample_joint(strategy, model, generation, draft=None, **settings):
    samples = []
    for seed in range(SAMPLES):
        gen = GenerationSettings(
            max_new_tokens=N_TOKENS,
            temperature=generation.temperature,
            top_k=generation.top_k,
            top_p=generation.top_p,
            seed=seed,
        )
        out, _ = decode(model, strategy, PROMPT, gen, draft=draft, **settings)
        samples.append(tuple(out))
    return samples


@pytest.fixture(scope="module")
def models():
    # Peaked distributions (large init) and an unrelated draft make the rule matter.
    target = tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)
    draft = tiny_model("llama-2l", seed=1, vocab_size=V, initializer_range=0.4)
    return target, draft


WARPS = [GenerationSettings(temperature=1.0), GenerationSettings(temperature=0.8, top_k=5, top_p=0.9)]


@pytest.mark.slow
@pytest.mark.parametrize("generation", WARPS, ids=["t1", "t0.8-k5-p0.9"])
@pytest.mark.parametrize("strategy", ["autoregressive", "speculative", "prompt_lookup"])
def test_sampled_tokens_follow_the_exact_target_distribution(models, strategy, generation):
    target, draft = models
    exact = exact_joint(target, generation)
    settings = {"num_draft_tokens": 2} if strategy != "autoregressive" else {}
    samples = sample_joint(strategy, target, generation, draft=draft if strategy == "speculative" else None, **settings)
    result = goodness_of_fit(samples, exact)
    assert result.consistent, result


@pytest.mark.slow
def test_the_distribution_test_rejects_a_broken_rule(models, monkeypatch):
    """Negative control: resampling from p instead of norm(max(0, p − q)) is biased, and caught."""
    target, draft = models
    generation = WARPS[0]
    exact = exact_joint(target, generation)
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    samples = sample_joint("speculative", target, generation, draft=draft, num_draft_tokens=2)
    assert goodness_of_fit(samples, exact).p_value < 1e-6


def test_goodness_of_fit_flags_impossible_outcomes():
    assert goodness_of_fit([(0,), (1,)], {(0,): 1.0}).p_value == 0.0


def test_two_sample_test_separates_different_samples():
    same = two_sample([0, 1] * 200, [1, 0] * 200)
    different = two_sample([0] * 300 + [1] * 100, [0] * 100 + [1] * 300)
    assert same.consistent and not different.consistent
