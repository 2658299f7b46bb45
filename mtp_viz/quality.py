"""Is a strategy lossless? Token identity for greedy runs, distribution tests for sampling."""

import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from scipy import stats

from mtp_viz.errors import InvalidSettingsError, UserError
from mtp_viz.loading import load_model
from mtp_viz.runner import Run
from mtp_viz.sampling import probs_from_logits
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace

ALPHA = 1e-3  # significance level of the verdicts
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled, as chi-square tests require


@dataclass(frozen=True)
class TestResult:
    test: str
    statistic: float
    dof: int
    p_value: float

    @property
    def consistent(self) -> bool:
        return self.p_value >= ALPHA

    def as_dict(self) -> dict:
        verdict = "consistent" if self.consistent else "different"
        return {
            "test": self.test,
            "statistic": self.statistic,
            "dof": self.dof,
            "p_value": self.p_value,
            "alpha": ALPHA,
            "verdict": verdict,
        }


def goodness_of_fit(samples: Sequence[Hashable], probs: dict[Hashable, float]) -> TestResult:
    """Chi-square test of samples against an exactly known distribution (outcome → probability)."""
    n = len(samples)
    counts = Counter(samples)
    if set(counts) - set(probs):
        # An outcome the distribution gives probability 0: impossible under it.
        return TestResult("chi-square goodness of fit", float("inf"), 0, 0.0)
    big = [o for o, p in probs.items() if p * n >= MIN_EXPECTED]
    observed = [counts[o] for o in big]
    expected = [probs[o] * n for o in big]
    rest_exp = n - sum(expected)
    if rest_exp >= 1e-9 * n:
        observed.append(n - sum(observed))
        expected.append(rest_exp)
    if len(observed) < 2:
        return TestResult("chi-square goodness of fit", 0.0, 0, 1.0)
    expected = np.asarray(expected) * (n / sum(expected))  # absorb float rounding
    stat, p = stats.chisquare(observed, expected)
    return TestResult("chi-square goodness of fit", float(stat), len(observed) - 1, float(p))


def two_sample(a: Sequence[Hashable], b: Sequence[Hashable]) -> TestResult:
    """Chi-square test that two samples come from one distribution (rare outcomes pooled)."""
    ca, cb = Counter(a), Counter(b)
    total = len(a) + len(b)
    share_a = len(a) / total
    outcomes = sorted(set(ca) | set(cb), key=lambda o: -(ca[o] + cb[o]))
    big = [o for o in outcomes if (ca[o] + cb[o]) * min(share_a, 1 - share_a) >= MIN_EXPECTED]
    table = [[ca[o] for o in big], [cb[o] for o in big]]
    rest = [len(a) - sum(table[0]), len(b) - sum(table[1])]
    if sum(rest):
        table[0].append(rest[0])
        table[1].append(rest[1])
    if len(table[0]) < 2:
        return TestResult("chi-square two-sample", 0.0, 0, 1.0)
    res = stats.chi2_contingency(np.asarray(table), correction=False)
    return TestResult("chi-square two-sample", float(res.statistic), int(res.dof), float(res.pvalue))


def first_token_distribution(model, prompt_ids: list[int], generation: GenerationSettings, vocab_size: int):
    """The exact warped distribution of the first new token: {token id: probability}."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1, :vocab_size].float()
    probs = probs_from_logits(logits, generation.warp).cpu()
    nz = torch.nonzero(probs).flatten().tolist()
    return {t: float(probs[t]) for t in nz}


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in a text (commas dropped, trailing .0 removed): a math answer to compare."""
    found = NUMBER.findall(text or "")
    if not found:
        return None
    number = found[-1].replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def reference_answer(reference: str | None) -> str | None:
    """A GSM8K-style reference's final answer (the number after "####"), or None."""
    if not reference or "####" not in reference:
        return None
    return final_number(reference.rsplit("####", 1)[1])


@torch.inference_mode()
def target_nll(model, prompt_ids: list[int], output_ids: list[int], vocab_size: int | None = None) -> float:
    """Mean negative log-likelihood per token of `output_ids` after `prompt_ids`, under `model`
    (the original model's judgement of a text; NaN for an empty output)."""
    if not output_ids:
        return float("nan")
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1, : vocab_size or model.config.vocab_size].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids) :]))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token sequences differ, or None if identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_distribution(request, samples: int) -> dict:
    """Sample `request.generation.max_new_tokens` tokens `samples` times with autoregressive
    sampling and with `request.strategy` (seeds seed .. seed+samples-1 for the first, the next
    `samples` seeds for the second), and test that they agree.

    Returns {"autoregressive": [[ids...], ...], "<strategy>": [[ids...], ...], "verdict": {...}}.
    """
    if request.generation.warp.greedy:
        raise InvalidSettingsError("the distribution check needs sampling: set a temperature above 0")
    out: dict = {}
    runs = {}
    for offset, strategy in enumerate(dict.fromkeys(("autoregressive", request.strategy))):
        outputs = []
        for i in range(samples):
            # Disjoint seeds per sampler: shared seeds would couple the samples and make the
            # two-sample test blind to a difference.
            gen = replace(request.generation, seed=request.generation.seed + offset * samples + i)
            run = Run(
                replace(
                    request,
                    strategy=strategy,
                    generation=gen,
                    strategy_settings=request.strategy_settings if strategy == request.strategy else {},
                )
            )
            for _ in run.steps():
                pass
            outputs.append(run.trace.output_token_ids)
        out[strategy] = outputs
        runs[strategy] = run
    run = runs[request.strategy]
    exact = first_token_distribution(run.target.model, run.prompt_ids, request.generation, run.vocab_size)
    verdict = {
        "first_token_vs_exact": {s: goodness_of_fit([o[0] for o in outs], exact).as_dict() for s, outs in out.items()},
    }
    if request.strategy != "autoregressive":
        verdict["sequences_two_sample"] = two_sample(
            [tuple(o) for o in out["autoregressive"]], [tuple(o) for o in out[request.strategy]]
        ).as_dict()
    tests = [v for v in verdict["first_token_vs_exact"].values()] + (
        [verdict["sequences_two_sample"]] if "sequences_two_sample" in verdict else []
    )
    verdict["overall"] = "consistent" if all(t["verdict"] == "consistent" for t in tests) else "different"
    out["verdict"] = verdict
    return out


NEAR_TIE_LOGIT_GAP = 1e-2  # top-two logit gap below which rounding can flip the argmax (fp32/bf16)


@dataclass(frozen=True)
class Divergence:
    position: int  # index in the output where the token ids first differ
    reference_token: int | None
    other_token: int | None
    logit_gap: float | None  # target's top-1 minus top-2 logit at that position
    near_tie: bool

    def explain(self) -> str:
        if self.logit_gap is None:
            return f"outputs differ in length after position {self.position}"
        if self.near_tie:
            return (
                f"first divergence at token {self.position}: the target's top two logits differ by only "
                f"{self.logit_gap:.2g}, a numerical near-tie (batched vs one-token forwards round differently)"
            )
        return (
            f"first divergence at token {self.position} with a clear top-1 margin of {self.logit_gap:.3g} "
            "logits: this is a bug, not rounding"
        )


def diagnose_divergence(model, prompt_ids: list[int], reference: list[int], other: list[int]) -> Divergence | None:
    """Where two greedy outputs part, and whether the target was nearly tied there."""
    i = first_divergence(reference, other)
    if i is None:
        return None
    ref_tok = reference[i] if i < len(reference) else None
    oth_tok = other[i] if i < len(other) else None
    if ref_tok is None or oth_tok is None:
        return Divergence(i, ref_tok, oth_tok, None, False)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + reference[:i]], device=model.device)
        logits = model(ids, logits_to_keep=1).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    return Divergence(i, ref_tok, oth_tok, gap, gap < NEAR_TIE_LOGIT_GAP)


def lossless_verdict(reference, other, model=None) -> str:
    """One line for the compare view: identical, or where and why a lossless run departed from
    autoregressive decoding. `model` (the target) enables the near-tie diagnosis."""
    if other.settings.get("temperature", 0.0) != 0.0:
        return "sampling: individual outputs differ by design; the distribution check tests losslessness"
    if other.output_token_ids == reference.output_token_ids:
        return "identical to autoregressive"
    if model is None:
        i = first_divergence(reference.output_token_ids, other.output_token_ids)
        return f"differs from autoregressive at token {i} (load the target model to diagnose)"
    d = diagnose_divergence(model, reference.prompt_token_ids, reference.output_token_ids, other.output_token_ids)
    return d.explain()


LOSSY = "lossy by design: quality is measured, not assumed"


def verdicts(traces: list[Trace]) -> dict[str, str]:
    """strategy → one line, for the runs after the first (autoregressive, the reference): a
    lossless strategy's `lossless_verdict`, with the target loaded to diagnose a departure where
    this machine can load it; a lossy one said to be so."""
    reference = traces[0]
    model = None
    out = {}
    for t in traces[1:]:
        if STRATEGIES[t.strategy].is_lossless(t.settings):
            if model is None and t.output_token_ids != reference.output_token_ids:
                try:
                    model = load_model(reference.model).model
                except UserError:  # an uploaded trace of a model this machine cannot load
                    model = None
            out[t.strategy] = lossless_verdict(reference, t, model)
        else:
            out[t.strategy] = LOSSY
    return out
