"""Cross-engine check for an EAGLE-3 drafter (issue 31 §3): the same Spec-Bench prompts, greedy, on
our engine's `eagle` as a chain and on vLLM's EAGLE-3 at the same depth, beside vLLM without
speculation, one request at a time (one client).

    nice .venv/bin/python experiments/eagle3_cross_engine.py --eagle3 assets/eagle3/smollm2-135m-eagle3 \
        --prompts 13 2>&1 | tee docs/results/eagle3-cross-engine.log

`--eagle3` is a checkpoint directory (or a registry id) for the target `--model`. Prints per prompt
and in the mean: tokens per target forward on both engines (vLLM's prefill never drafts, so both
are also given without the first step), whether vLLM EAGLE-3's output equals vLLM AR's, and vLLM
EAGLE-3's tokens/s over vLLM AR's. Two vLLM servers are started one after the other (~2 min each
on a 2-core CPU), each warmed up with one untimed request first.
"""

import argparse
import statistics
from dataclasses import replace

import httpx

from mtp_viz.bench import load_suite
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.backend import VLLMPlan, open_server, plan, prompt_ids, request_body, to_trace, warm_up
from mtp_viz.serving.client import complete
from mtp_viz.serving.engines import after_prefill
from mtp_viz.serving.methods import CHAIN
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace


def served_traces(p: VLLMPlan, texts: list[str]) -> list[Trace]:
    """One greedy completion per prompt on a fresh server for plan `p`, after a warm-up."""
    with open_server(p, progress=lambda m: print(f"  {m}", flush=True)) as server, httpx.Client() as client:
        warm_up(client, server, p)
        return [to_trace(p, server, complete(client, server.url, request_body(p, prompt_ids(p, t)))) for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eagle3", required=True, help="EAGLE-3 checkpoint directory or registry id")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=2, help="the first N of Spec-Bench's 13 (one per category)")
    parser.add_argument("--depth", type=int, default=3, help="drafted tokens per step on both engines")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    prompts = load_suite("spec-bench", limit=1)[: args.prompts]
    texts = [q.text for q in prompts]
    base = RunRequest(model=args.model, generation=GenerationSettings(max_new_tokens=args.max_new_tokens))
    eagle = replace(
        base, strategy="eagle", eagle3=args.eagle3, strategy_settings={"draft_tree": CHAIN, "depth": args.depth}
    )

    print(f"our engine: eagle, chain of {args.depth}, drafter {args.eagle3}", flush=True)
    run(replace(eagle, prompt="Say hello."))  # warm-up: loads the models, measures what is measured once
    ours = [run(replace(eagle, prompt=t)) for t in texts]
    print("vLLM: autoregressive", flush=True)
    plain = served_traces(plan(base), texts)
    print(f"vLLM: EAGLE-3, num_speculative_tokens {args.depth}", flush=True)
    served = served_traces(plan(eagle), texts)

    print(
        f"\n{'prompt':<22} {'ours tok/fwd':>12} {'vLLM tok/fwd':>12} {'(no prefill)':>16} {'=AR':>4} {'vLLM x AR':>9}"
    )
    for q, o, e, a in zip(prompts, ours, served, plain, strict=True):
        ratio = e.summary["tokens_per_s"] / a.summary["tokens_per_s"]
        print(
            f"{q.category[:14] + ' ' + q.id:<22} {o.summary['mean_accepted_tokens']:>12.2f} "
            f"{e.summary['mean_accepted_tokens']:>12.2f} {after_prefill(o):>7.2f} / {after_prefill(e):<6.2f} "
            f"{'yes' if e.output_token_ids == a.output_token_ids else 'NO':>4} {ratio:>9.2f}"
        )
    mean = statistics.fmean
    same = sum(e.output_token_ids == a.output_token_ids for e, a in zip(served, plain, strict=True))
    ours_len, vllm_len = mean(after_prefill(t) for t in ours), mean(after_prefill(t) for t in served)
    print(
        f"\nmean accepted length (tokens per target forward, after the prefill): ours {ours_len:.3f}, "
        f"vLLM {vllm_len:.3f} ({(ours_len - vllm_len) / vllm_len:+.1%} ours vs vLLM)"
    )
    print(f"vLLM EAGLE-3 output identical to vLLM AR: {same}/{len(texts)} prompts")
    speed = sum(t.summary["new_tokens"] for t in served) / sum(t.wall_time_s for t in served)
    speed_ar = sum(t.summary["new_tokens"] for t in plain) / sum(t.wall_time_s for t in plain)
    print(f"vLLM EAGLE-3 {speed:.1f} tok/s vs vLLM AR {speed_ar:.1f} tok/s at one client: {speed / speed_ar:.2f}x")
    print(f"served as: {served[0].machine.get('served_note')}")


if __name__ == "__main__":
    main()
