"""Every lossless strategy, greedy, emits exactly the tokens of plain autoregressive decoding and of
transformers' generate(do_sample=False), on tiny random models. (MTP heads, which need scripted
heads, have the same tests in test_mtp_heads.py; eagle runs here with a scripted EAGLE-3 drafter
that is wrong at depth 2, and with random ones in test_eagle_strategy.py.)"""

import pytest
from conftest import TINY_CONFIGS, decode, hf_greedy, perturbed, tiny_model
from test_eagle_strategy import ScriptedDrafter

from mtp_viz.cache import ENGINE_ENV, ENGINES
from mtp_viz.kernels import FIXED_PLAN, STOCK_PLAN, use_fast_linears
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import VERDICT_ACCEPTED, VERDICT_REJECTED

PROMPT = [5, 17, 3, 42, 9, 17, 3]
CASES = [(name, seed) for name in TINY_CONFIGS for seed in (0, 1)]


def _lossless_runs(model, draft, generation, eos=()):
    """(strategy label, output, steps) for each lossless strategy with a few draft lengths."""
    for k in (1, 3, 6):
        yield (
            f"speculative k={k}",
            *decode(model, "speculative", PROMPT, generation, draft=draft, eos=eos, num_draft_tokens=k),
        )
    yield (
        "speculative heuristic",
        *decode(
            model, "speculative", PROMPT, generation, draft=draft, eos=eos, num_draft_tokens=2, schedule="heuristic"
        ),
    )
    yield (
        "speculative confidence",
        *decode(
            model,
            "speculative",
            PROMPT,
            generation,
            draft=draft,
            eos=eos,
            num_draft_tokens=6,
            schedule="confidence",
            confidence_threshold=0.05,
        ),
    )
    yield ("self_speculative L=1", *decode(model, "self_speculative", PROMPT, generation, eos=eos, exit_layer=1))
    yield ("lookahead 5/7/7", *decode(model, "lookahead", PROMPT, generation, eos=eos, level=5, window=7, guess=7))
    yield (
        "lookahead 3/4/3 + prompt pool",
        *decode(model, "lookahead", PROMPT, generation, eos=eos, level=3, window=4, guess=3, pool_from_prompt=True),
    )
    # an EAGLE-3 drafter that knows the greedy continuation but guesses wrong first at depth 2
    continuation, _ = decode(model, "autoregressive", PROMPT, GenerationSettings(max_new_tokens=48))
    eagle3 = ScriptedDrafter(model, PROMPT, continuation, wrong_depth=2)
    yield ("eagle chain of 3", *decode(model, "eagle", PROMPT, generation, eos=eos, eagle3=eagle3, depth=3))
    dynamic = {"draft_tree": "dynamic", "depth": 3, "branching": 2, "nodes": 6}
    yield ("eagle dynamic", *decode(model, "eagle", PROMPT, generation, eos=eos, eagle3=eagle3, **dynamic))
    for k, n in ((3, 1), (8, 3)):  # n-gram sizes 1..1 and 2..3
        yield (
            f"prompt_lookup k={k} n={n}",
            *decode(
                model,
                "prompt_lookup",
                PROMPT,
                generation,
                eos=eos,
                num_draft_tokens=k,
                max_ngram_size=n,
                min_ngram_size=min(n, 2),
            ),
        )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("plan", [STOCK_PLAN, FIXED_PLAN], ids=["stock-linear", "fast-linear"])
@pytest.mark.parametrize("name,seed", CASES)
def test_greedy_identical_to_autoregressive_and_generate(name, seed, plan, engine, monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, engine)
    model = tiny_model(name, seed=seed)
    draft = perturbed(model, noise=0.2, seed=seed + 10)
    use_fast_linears(model, plan)  # each linear path forced, as loaded models run on a CPU
    use_fast_linears(draft, plan)
    generation = GenerationSettings(max_new_tokens=40)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    assert reference == hf_greedy(model, PROMPT, 40)
    for label, output, steps in _lossless_runs(model, draft, generation):
        assert output == reference, label
        # The comparison only means something if drafts were both kept and thrown away.
        verdicts = [v for s in steps for v in s.verdicts]
        assert VERDICT_ACCEPTED in verdicts and VERDICT_REJECTED in verdicts, label


@pytest.mark.parametrize("name,seed", CASES[:3])
def test_eos_inside_a_draft_block(name, seed):
    model = tiny_model(name, seed=seed)
    draft = perturbed(model, noise=0.1, seed=seed + 10)
    generation = GenerationSettings(max_new_tokens=40)
    free_run, _ = decode(model, "autoregressive", PROMPT, generation)
    # Make a token that appears mid-output the EOS: decoding must stop right after it.
    position = next(i for i in range(8, len(free_run)) if free_run[i] not in free_run[:i])
    eos = free_run[position]
    reference, _ = decode(model, "autoregressive", PROMPT, generation, eos=[eos])
    assert reference == free_run[: position + 1]
    assert reference == hf_greedy(model, PROMPT, 40, eos=eos)
    for label, output, steps in _lossless_runs(model, draft, generation, eos=[eos]):
        assert output == reference, label
        assert sum(len(s.emitted) for s in steps) == len(reference)


@pytest.mark.parametrize("budget", [1, 2, 5, 7, 13])
def test_token_budget_ending_inside_a_block(budget):
    model = tiny_model("llama-2l", seed=3)
    generation = GenerationSettings(max_new_tokens=budget)
    reference, _ = decode(model, "autoregressive", PROMPT, generation)
    assert len(reference) == budget
    # A draft equal to the target accepts everything, so the budget always ends mid-block.
    for label, output, _ in _lossless_runs(model, model, generation):
        assert output == reference, label


def test_draft_length_is_cut_to_the_budget():
    model = tiny_model("llama-2l", seed=3)
    _, steps = decode(
        model, "speculative", PROMPT, GenerationSettings(max_new_tokens=5), draft=model, num_draft_tokens=8
    )
    assert [len(s.drafted) for s in steps] == [4]
    assert [e.origin for e in steps[0].emitted] == ["accepted"] * 4 + ["bonus"]


def test_prompt_lookup_without_a_match_is_one_token_per_forward():
    model = tiny_model("llama-2l", seed=0)
    prompt = list(range(10, 30))  # no repeated n-gram to copy
    _, steps = decode(model, "prompt_lookup", prompt, GenerationSettings(max_new_tokens=1))
    assert steps[0].drafted == [] and steps[0].input_tokens == len(prompt)
    assert [e.origin for e in steps[0].emitted] == ["autoregressive"]


def test_heuristic_schedule_grows_after_full_acceptance_and_shrinks_after_a_miss():
    model = tiny_model("llama-2l", seed=0)
    draft = perturbed(model, noise=0.2, seed=10)
    _, steps = decode(
        model,
        "speculative",
        PROMPT,
        GenerationSettings(max_new_tokens=60),
        draft=draft,
        num_draft_tokens=2,
        schedule="heuristic",
    )
    lengths = [s.extra["draft_len"] for s in steps]
    for before, after, step in zip(lengths, lengths[1:], steps, strict=False):
        full = step.accepted == len(step.drafted)
        assert (
            after in ((before + 2,) if full else (max(1, before - 1),))
            or after < before + 2
            and step.index == len(steps) - 2
        )
    assert len(set(lengths)) > 2  # it moved both ways


def test_confidence_schedule_stops_at_an_unsure_draft_token():
    model = tiny_model("llama-2l", seed=0)
    draft = perturbed(model, noise=0.2, seed=10)
    generation = GenerationSettings(max_new_tokens=40)
    _, constant = decode(model, "speculative", PROMPT, generation, draft=draft, num_draft_tokens=8)
    confidences = sorted(d.q for s in constant for d in s.drafted)
    threshold = confidences[len(confidences) // 2]  # the median draft confidence
    _, steps = decode(
        model,
        "speculative",
        PROMPT,
        generation,
        draft=draft,
        num_draft_tokens=8,
        schedule="confidence",
        confidence_threshold=threshold,
    )
    lengths = {len(s.drafted) for s in steps[:-2]}
    assert len(lengths) > 1 and max(lengths) <= 8
    for s in steps:  # every drafted token but the last was drafted confidently (greedy q = top probability)
        assert all(d.q >= threshold for d in s.drafted[:-1])
        assert not s.drafted or len(s.drafted) == 8 or s.drafted[-1].q < threshold or s.index >= len(steps) - 3
