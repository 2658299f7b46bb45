"""F.linear against the linear path this machine measured (mtp_viz.kernels), side by side.

    python benchmarks/cpu_linear.py [--model smollm2-135m] [--draft smollm2-135m-draft] [--repeats 7]

1. The products decoding does: every weight matrix of the target (all layers, then the output
   head), times m rows, m = 1 … 64. All layers are run in turn, so the weights come from memory
   as they do in a forward, not from cache.
2. Whole forwards: the verify-cost curve and the draft cost ratio c (mtp_viz.profile), with
   each way in turn, round after round.
3. Greedy autoregressive decoding of one Spec-Bench prompt: tokens/s each way, same tokens.

"fast" is the plan measured for the model on first load (`MTP_VIZ_LINEAR=auto`); "stock" is
F.linear everywhere. Rounds are interleaved (stock, fast, stock, fast, …) and medians reported, so
machine noise hits both alike. Only float32 on a CPU is affected; elsewhere both run F.linear.
`--draft ""` leaves out the draft (and c). Its tables are in docs/BENCHMARKS.md, "Few-row products
on this CPU"; log in docs/results/cpu-linear.log.
"""

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from mtp_viz import kernels
from mtp_viz.loading import encode_prompt, load_model, quiet_transformers
from mtp_viz.profile import profile
from mtp_viz.prompts import spec_bench_prompt
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings

ROWS = (1, 2, 3, 4, 5, 8, 16, 32, 64)
VERIFY_K = (1, 2, 3, 4, 5, 8, 10, 16)


def use(models, way: str, plan: kernels.Plan) -> None:
    """Every model on the measured plan ("fast") or on F.linear ("stock")."""
    for m in models:
        kernels.use_fast_linears(m, plan if way == "fast" else kernels.STOCK_PLAN)


def products(model, repeats: int) -> None:
    layers = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    groups = {"all layers": layers, "output head": [model.get_output_embeddings().weight]}
    print(f"\n1. products (ms; median of {repeats}; all weights in turn)")
    plan = kernels.plan_of(model)
    print(f"measured plan: {plan.describe()}")
    print("| weights | rows | F.linear | measured path | ratio |\n|---|---|---|---|---|")
    for label, weights in groups.items():
        for m in ROWS:
            xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
            times = {"stock": [], "fast": []}
            for _ in range(repeats):
                fast = lambda x, w: kernels.fast_linear(x, w, plan=plan)  # noqa: E731
                for way, fn in (("stock", F.linear), ("fast", fast)):
                    start = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    times[way].append(time.perf_counter() - start)
            s, f = (statistics.median(times[w]) * 1e3 for w in ("stock", "fast"))
            print(f"| {label} | {m} | {s:.2f} | {f:.2f} | {s / f:.2f}x |", flush=True)


def forwards(target, draft, repeats: int) -> None:
    runs = {"stock": [], "fast": []}
    models = [target.model] + ([draft.model] if draft else [])
    plans = [kernels.plan_of(m) for m in models]
    for _ in range(repeats):
        for way in runs:
            for m, plan in zip(models, plans, strict=True):
                use([m], way, plan)
            runs[way].append(profile(target, draft, max_k=max(VERIFY_K), repeats=1, batch_sizes=()))  # B × k: unused
    for m, plan in zip(models, plans, strict=True):
        use([m], "fast", plan)
    print(f"\n2. whole forwards (median of {repeats} rounds; cost relative to the same way's one-token forward)")
    print("| way | one-token ms | " + " | ".join(f"k={k}" for k in VERIFY_K) + " | c |")
    print("|---|---|" + "---|" * (len(VERIFY_K) + 1))
    for way, profiles in runs.items():
        one = statistics.median(p.one_token_s for p in profiles)
        costs = [statistics.median(p.one_token_s * p.verify_cost[k] for p in profiles) / one for k in VERIFY_K]
        c = statistics.median(p.c for p in profiles) if draft is not None else float("nan")
        print(f"| {way} | {one * 1e3:.1f} | " + " | ".join(f"{x:.2f}" for x in costs) + f" | {c:.3f} |")
    one = {w: statistics.median(p.one_token_s for p in ps) for w, ps in runs.items()}
    print(f"one-token forward, stock / fast: {one['stock'] / one['fast']:.2f}x")


def decoding(target, tokens: int, repeats: int) -> None:
    ids = encode_prompt(target, spec_bench_prompt(81))
    request = RunRequest(
        model=target.name,
        strategy="autoregressive",
        prompt_ids=tuple(ids),
        generation=GenerationSettings(max_new_tokens=tokens),
    )
    rate, outputs = {"stock": [], "fast": []}, {}
    plan = kernels.plan_of(target.model)
    for _ in range(repeats):
        for way in rate:
            use([target.model], way, plan)
            trace = run(request)
            rate[way].append(trace.summary["tokens_per_s"])
            outputs[way] = trace.output_token_ids
    use([target.model], "fast", plan)
    s, f = (max(rate[w]) for w in ("stock", "fast"))
    print(f"\n3. greedy autoregressive, Spec-Bench 81, {tokens} tokens, best of {repeats}")
    print(
        f"tokens/s: stock {s:.1f}, fast {f:.1f}, ratio {f / s:.2f}x; same tokens: {outputs['stock'] == outputs['fast']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-135m-draft")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    quiet_transformers()
    torch.manual_seed(0)
    target = load_model(args.model)
    draft = load_model(args.draft) if args.draft else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {target.device}, {target.dtype}")
    with torch.inference_mode():
        products(target.model, args.repeats)
    forwards(target, draft, args.repeats)
    decoding(target, args.tokens, max(3, args.repeats // 2))


if __name__ == "__main__":
    main()
