"""The power of tests/test_distribution.py's chi-square tests, per case, against the defect its
negative control plants (a rejection resampling from p instead of norm(max(0, p − q))):

    .venv/bin/python experiments/distribution_power.py [--samples 1000] [--labels lookahead,self_speculative]

For each case (strategy label × warp) it samples with the defect planted, measures the effect size
w² = Σ (p_broken − p)² / p over the cells the test uses at n samples (those expected ≥ MIN_EXPECTED
times, the rest pooled; E[X²/m] = w² + df/m on m samples, so df/m is taken off), and prints the
power at n samples: P(noncentral χ²(df, λ = n·w²) > the χ² quantile at ALPHA). Produced the
figures in that module's docstring (1000 samples a case, 3000 for lookahead, self_speculative
and eagle-chain, 2026-12-06); SAMPLES and MORE_SAMPLES there are set from them.
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_distribution as td  # noqa: E402 (tests/ on the path first)
from conftest import OracleHeads, decode  # noqa: E402
from test_eagle_strategy import ScriptedDrafter  # noqa: E402
from test_mask_mtp import random_adapter  # noqa: E402

import mtp_viz.sampling as sampling  # noqa: E402
from mtp_viz.quality import ALPHA, MIN_EXPECTED  # noqa: E402
from mtp_viz.strategies.base import GenerationSettings  # noqa: E402

SIZES = (1000, 1500, 2000, 3000)  # sample counts the power is given at


def case_inputs(label: str, target, draft):
    """(model, settings, tokens, drafters) as the test builds them for `label`."""
    strategy, settings, n = td.SAMPLED[label]
    drafters = {"draft": draft}
    if strategy in ("mtp_heads", "eagle"):
        greedy, _ = decode(target, "autoregressive", td.PROMPT, GenerationSettings(max_new_tokens=4))
        if strategy == "mtp_heads":
            drafters["heads"] = OracleHeads(target, td.PROMPT, greedy, wrong_every=2)
        else:
            drafters["eagle3"] = ScriptedDrafter(target, td.PROMPT, greedy, wrong_depth=2)
    if strategy == "mask_spec":
        return random_adapter(target, scale=0.3), {**settings, "mask_token_id": td.V}, n, drafters
    return target, settings, n, drafters


def power(samples: list[tuple], exact: dict[tuple, float], n: int) -> tuple[float, float]:
    """(w², power at n samples) of the test's chi-square against the distribution `samples` follow."""
    counts, m = Counter(samples), len(samples)
    big = [o for o, p in exact.items() if p * n >= MIN_EXPECTED]
    p0 = np.array([exact[o] for o in big] + [1 - sum(exact[o] for o in big)])
    p1 = np.array([counts[o] / m for o in big] + [1 - sum(counts[o] for o in big) / m])
    keep = p0 > 1e-9
    df = int(keep.sum() - 1)
    w2 = float(((p1[keep] - p0[keep]) ** 2 / p0[keep]).sum()) - df / m
    return w2, float(stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, max(n * w2, 1e-9)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000, help="samples per case with the defect planted")
    parser.add_argument("--labels", default=",".join(td.SAMPLED), help="the cases' labels, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling.residual_distribution = lambda p, q: p  # the defect
    target = td.tiny_model("llama-2l", seed=0, vocab_size=td.V, initializer_range=0.4)
    draft = td.tiny_model("llama-2l", seed=1, vocab_size=td.V, initializer_range=0.4)
    print("| case | " + " | ".join(f"w² / power at {n}" for n in SIZES) + " |")
    for label in args.labels.split(","):
        model, settings, tokens, drafters = case_inputs(label, target, draft)
        for warp, generation in td.WARPS.items():
            strategy = td.SAMPLED[label][0]
            exact = td.exact_joint(target, generation, tokens)
            samples = td.sample_joint(
                strategy, model, generation, n_tokens=tokens, samples=args.samples, **drafters, **settings
            )
            cells = [power(samples, exact, n) for n in SIZES]
            print(f"| {label}-{warp} | " + " | ".join(f"{w2:.3f} / {p:.4f}" for w2, p in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
