"""Sampled output is distributed exactly as the target's: the empirical distribution of the first
tokens matches the distribution computed exactly from a tiny model with a small vocabulary.

Power: against the defect the negative control plants (a rejection resampling from p instead of
norm(max(0, p − q))), every case's chi-square test rejects at ALPHA with probability ≥ 0.99 at
its sample count (SAMPLES, or MORE_SAMPLES). Computed per case from the defect's effect size
w² = Σ (p_broken − p)² / p over the test's cells, measured with the defect planted (1000 samples a
case, 3000 for the weakest), through the noncentral chi-square with λ = n·w²: w² runs from 0.05
(lookahead at t = 1: power 0.998 at 1500 samples) to 0.24 (prompt lookup), and self_speculative
at t = 1 measured 0.03 to 0.06 (power 0.75 to 0.999 at 1500), so it keeps 3000."""

import itertools

import pytest
import torch
from conftest import OracleHeads, decode, tiny_model
from test_eagle_strategy import ScriptedDrafter

import mtp_viz.sampling as sampling
from mtp_viz.quality import goodness_of_fit, two_sample
from mtp_viz.sampling import probs_from_logits
from mtp_viz.strategies.base import GenerationSettings

V = 8
N_TOKENS = 2
SAMPLES = 1500  # per case; see Power above
MORE_SAMPLES = {("self_speculative", "t1"): 3000}  # (label, warp) → the samples its power needs
# Repeats, so prompt lookup and lookahead draft. Chosen by a search over [a, b, c, a, b] so that
# every strategy below both accepts and rejects under both warps (asserted in the test).
PROMPT = [3, 1, 5, 3, 1]


def exact_joint(model, generation, n_tokens: int = N_TOKENS) -> dict[tuple[int, ...], float]:
    """P(first n tokens) by enumerating every sequence of the tiny vocabulary."""
    out = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        prob = 1.0
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(seq)])).logits[0, len(PROMPT) - 1 :]
        dists = probs_from_logits(logits, generation.warp)
        for i, t in enumerate(seq):
            prob *= float(dists[i, t])
        out[seq] = prob
    return out


def sample_joint(
    strategy,
    model,
    generation,
    draft=None,
    heads=None,
    n_tokens=N_TOKENS,
    verdicts=None,
    traces=None,
    samples=SAMPLES,
    **settings,
):
    out = []
    for seed in range(samples):
        gen = GenerationSettings(
            max_new_tokens=n_tokens,
            temperature=generation.temperature,
            top_k=generation.top_k,
            top_p=generation.top_p,
            seed=seed,
        )
        tokens, steps = decode(model, strategy, PROMPT, gen, draft=draft, heads=heads, **settings)
        out.append(tuple(tokens))
        if verdicts is not None:
            verdicts.update(v for s in steps for v in s.verdicts)
        if traces is not None:
            traces.append(steps)
    return out


@pytest.fixture(scope="module")
def models():
    # Peaked distributions (large init) and an unrelated draft make the rule matter.
    target = tiny_model("llama-2l", seed=0, vocab_size=V, initializer_range=0.4)
    draft = tiny_model("llama-2l", seed=1, vocab_size=V, initializer_range=0.4)
    return target, draft


WARPS = {
    "t1": GenerationSettings(temperature=1.0),
    "t0.8-k5-p0.9": GenerationSettings(temperature=0.8, top_k=5, top_p=0.9),
}


SAMPLED = {  # label → (strategy, settings, tokens sampled: enough for the strategy to draft)
    "autoregressive": ("autoregressive", {}, 2),
    "speculative": ("speculative", {"num_draft_tokens": 2}, 2),
    "speculative-heuristic": ("speculative", {"num_draft_tokens": 1, "schedule": "heuristic"}, 3),
    "prompt_lookup": ("prompt_lookup", {"num_draft_tokens": 2}, 2),
    # these draft only after a first plain forward, so they need a longer sample
    "lookahead": ("lookahead", {"level": 3, "window": 3, "guess": 3, "pool_from_prompt": True}, 3),
    "self_speculative": ("self_speculative", {"exit_layer": 1, "num_draft_tokens": 2}, 3),
    "mtp_heads-tree": ("mtp_heads", {"tree": "0,1,00,10"}, 3),
    "eagle-chain": ("eagle", {"depth": 2}, 3),
    "eagle-dynamic": ("eagle", {"draft_tree": "dynamic", "depth": 2, "branching": 2, "nodes": 4}, 3),
    # drafts only after its first forward; a random mask-only adapter on the target. Branched, a
    # step after a rejection verifies the guesses of a block off an earlier position: 4 tokens
    "mask_spec-chained": ("mask_spec", {"k": 3, "branches": False}, 3),
    "mask_spec-branched": ("mask_spec", {"k": 3, "branches": True}, 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("label", list(SAMPLED))
def test_sampled_tokens_follow_the_exact_target_distribution(models, label, warp):
    target, draft = models
    generation = WARPS[warp]
    strategy, settings, n = SAMPLED[label]
    exact = exact_joint(target, generation, n)
    heads = eagle3 = None
    if strategy in ("mtp_heads", "eagle"):  # drafters that guess the greedy continuation, sometimes wrong-first
        greedy, _ = decode(target, "autoregressive", PROMPT, GenerationSettings(max_new_tokens=4))
        heads = OracleHeads(target, PROMPT, greedy, wrong_every=2) if strategy == "mtp_heads" else None
        eagle3 = ScriptedDrafter(target, PROMPT, greedy, wrong_depth=2) if strategy == "eagle" else None
    model = target
    if strategy == "mask_spec":
        from test_mask_mtp import random_adapter

        model, settings = random_adapter(target, scale=0.3), {**settings, "mask_token_id": V}
    verdicts, traces = set(), []
    samples = sample_joint(
        strategy,
        model,
        generation,
        draft=draft,
        heads=heads,
        n_tokens=n,
        verdicts=verdicts,
        traces=traces,
        samples=MORE_SAMPLES.get((label, warp), SAMPLES),
        eagle3=eagle3,
        **settings,
    )
    result = goodness_of_fit(samples, exact)
    assert result.consistent, result
    if strategy != "autoregressive":  # the rule was exercised both ways
        assert {"accepted", "rejected"} <= verdicts, verdicts
    if label == "mask_spec-branched":  # guesses from a block off an earlier position were verified
        assert any(
            before.emitted[-1].origin == "resampled" and after.drafted
            for steps in traces
            for before, after in zip(steps, steps[1:], strict=False)
        )


@pytest.mark.slow
def test_the_distribution_test_rejects_a_broken_rule(models, monkeypatch):
    """Negative control: resampling from p instead of norm(max(0, p − q)) is biased, and caught."""
    target, draft = models
    generation = WARPS["t1"]
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
