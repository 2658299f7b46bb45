"""Engine benchmark: our decoding loops next to transformers' generate and llama.cpp, measured side by side.

    python benchmarks/engine.py [--model smollm2-135m] [--max-new-tokens 128] [--repeats 3] [--methods M,M,...]
                                [--weights q4|fp32|bf16|int8|auto]

Our engine runs the weights llama.cpp runs by default (q4: the shipped GGUF's own Q4_1 codes, its
head Q8_0), transformers' methods the fp32 model. For each prompt every method runs `repeats`
times, interleaved round-robin so that machine noise hits all of them alike; the best tokens/s of
each is reported (noise on a shared machine only ever slows a deterministic run down), with
ratios. Greedy decoding, so every method on the same weights must produce the same tokens
(checked and printed); llama.cpp, on the 4-bit weights with 8-bit activations, parts from ours at
near-ties: where, and by how many logits our model preferred its token, is printed.

Methods (METHODS below): our autoregressive loop on the lean forward (eager, compiled) and on
transformers' forward; transformers' `generate` on the plain model, and with its own fast path
(static cache + torch.compile, compiled in an untimed call per prompt); prompt lookup on both sides;
llama.cpp on the shipped GGUF (plain and with llama-cpp-python's prompt-lookup drafter), with our
thread count, where llama-cpp-python is installed (`bash scripts/setup.sh --llama`; skipped with
one line where it is not). Its greedy tokens are compared with ours like every other method's.

Tracing overhead is reported twice: as the tokens/s ratio of full vs minimal recording (within
the run-to-run noise), and directly, as the measured cost per token of what full recording adds
(the target probability of each token and its text) against the measured time of a step.

Its tables are in docs/BENCHMARKS.md ("Ours against transformers, side by side"; "Engine: ours vs
transformers `generate` (issue 2)"), its logs and `--out` JSON in docs/results/engine-bench*.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from mtp_viz.cache import ENGINE_ENV, LEAN, TRANSFORMERS
from mtp_viz.clock import Clock
from mtp_viz.llama_peers import (
    LLAMA_CPP_AUTOREGRESSIVE,
    LLAMA_CPP_PROMPT_LOOKUP,
    LlamaCppPeers,
    PeerFailed,
    parting,
    unavailable,
)
from mtp_viz.loading import encode_prompt, load_model, quiet_transformers
from mtp_viz.machine import describe_peer, machine_info, machine_label
from mtp_viz.peers import HF_GENERATE, HF_PROMPT_LOOKUP, HF_STATIC_COMPILE, run_peer
from mtp_viz.prompts import CODE_EDIT_PROMPT, spec_bench_prompt
from mtp_viz.quality import first_divergence
from mtp_viz.runner import RECORD_MINIMAL, RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.prompt_lookup import PromptLookupSettings
from mtp_viz.weights import CHOICES, FP32, Q4

PROMPTS = {
    "code-edit": CODE_EDIT_PROMPT,
    "summarization (Spec-Bench 241)": spec_bench_prompt(241),
    "rag (Spec-Bench 481)": spec_bench_prompt(481),
    "writing (Spec-Bench 81)": spec_bench_prompt(81),
    "coding (Spec-Bench 121)": spec_bench_prompt(121),
}
METHODS = (
    "ours_ar",  # the lean forward, eager, the measured linear path: what `run` does on a CPU
    "ours_ar_minimal",  # the same without token texts and probabilities: what tracing costs
    "ours_ar_compiled",  # the lean forward under torch.compile (--compile on)
    "ours_ar_transformers_forward",  # our loop on transformers' forward (MTP_VIZ_ENGINE=transformers)
    "ours_pld",
    "ours_pld_nomatch",
    "hf_plain",  # transformers' generate on the plain model
    "hf_static_compile",  # transformers' generate with its static cache + torch.compile
    "hf_pld",
)
NO_MATCH = {"min_ngram_size": 16, "max_ngram_size": 16}  # never matches here: the lookup's own cost
PEER_OF = {"hf_plain": HF_GENERATE, "hf_static_compile": HF_STATIC_COMPILE, "hf_pld": HF_PROMPT_LOOKUP}
# Optional methods: llama.cpp on the same GGUF at its own bits, plain and with llama-cpp-python's
# prompt-lookup drafter (our draft settings); skipped with one line where they cannot run.
LLAMA_CPP_OF = {"llama_cpp_ar": LLAMA_CPP_AUTOREGRESSIVE, "llama_cpp_pld": LLAMA_CPP_PROMPT_LOOKUP}
ALL_METHODS = METHODS + tuple(LLAMA_CPP_OF)


def ours(model: str, prompt: str, max_new: int, method: str, weights: str = FP32) -> tuple[list[int], float]:
    strategy = "prompt_lookup" if method.startswith("ours_pld") else "autoregressive"
    record = RECORD_MINIMAL if method == "ours_ar_minimal" else "full"
    settings = NO_MATCH if method == "ours_pld_nomatch" else {}
    engine = TRANSFORMERS if method == "ours_ar_transformers_forward" else LEAN
    previous = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = engine
    try:
        trace = run(
            RunRequest(
                prompt=prompt,
                model=model,
                strategy=strategy,
                record=record,
                strategy_settings=settings,
                compile="on" if method == "ours_ar_compiled" else "off",
                generation=GenerationSettings(max_new_tokens=max_new),
                weights=weights,
            )
        )
    finally:
        os.environ.pop(ENGINE_ENV) if previous is None else os.environ.__setitem__(ENGINE_ENV, previous)
    return trace.output_token_ids, trace.wall_time_s


def hf(loaded, prompt_ids: list[int], max_new: int, method: str) -> tuple[list[int], float]:
    pld = PromptLookupSettings()
    r = run_peer(
        PEER_OF[method],
        loaded,
        prompt_ids,
        max_new,
        num_draft_tokens=pld.num_draft_tokens,
        max_ngram_size=pld.max_ngram_size,
    )
    return r.output_token_ids, r.wall_time_s


def print_direct_costs(loaded, args) -> None:
    """Costs too small for tokens/s ratios on a noisy machine, timed directly."""
    per_token, step = tracing_cost(loaded)
    print(
        f"\ntracing cost measured directly: {per_token * 1e6:.0f} µs per token (target probability + token text) "
        f"against a {step * 1e3:.1f} ms one-token step = {per_token / step:.2%}"
    )
    for name, prompt in list(PROMPTS.items())[: args.prompts]:
        trace = run(
            RunRequest(
                prompt=prompt,
                model=args.model,
                strategy="prompt_lookup",
                strategy_settings=NO_MATCH,
                generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
            )
        )
        lookup = sum(s.draft_s for s in trace.steps)
        total = sum(s.step_s for s in trace.steps)
        print(
            f"n-gram lookup with no match, {name}: {lookup / len(trace.steps) * 1e6:.0f} µs per step "
            f"= {lookup / total:.2%} of decoding time"
        )


def tracing_cost(loaded, reps: int = 200) -> tuple[float, float]:
    """Seconds per token of what full recording adds, and seconds of one decode step."""
    from mtp_viz.cache import CachedModel
    from mtp_viz.detok import TextTracker

    prompt_ids = encode_prompt(loaded, CODE_EDIT_PROMPT)
    ids = encode_prompt(loaded, CODE_EDIT_PROMPT, raw=True)[:reps]
    cached = CachedModel(loaded.model)
    logits = cached.forward(prompt_ids)[-1]
    clock = Clock(loaded.device)
    start = clock.now()
    for _ in range(5):
        cached.forward(prompt_ids + ids[:1])
        cached.rollback(len(prompt_ids))
    step = (clock.now() - start) / 5
    tracker = TextTracker(loaded.tokenizer, prompt_ids)
    start = clock.now()
    for t in ids:
        float(torch.softmax(logits, -1)[t])
        tracker.commit([t])
    return (clock.now() - start) / len(ids), step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts only")
    parser.add_argument("--out", type=Path, help="write the raw measurements as JSON")
    parser.add_argument(
        "--weights",
        choices=CHOICES,
        default=Q4,
        help="our engine's weight format (default q4: the GGUF's bits, as llama.cpp runs them; transformers' fp32)",
    )
    parser.add_argument("--direct-only", action="store_true", help="only the direct cost measurements (fast)")
    parser.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help="comma-separated subset of METHODS and LLAMA_CPP_OF (ours_ar always runs)",
    )
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - set(ALL_METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}; choose from {', '.join(ALL_METHODS)}")
    methods = [m for m in ALL_METHODS if m == "ours_ar" or m in args.methods.split(",")]
    if set(methods) & set(LLAMA_CPP_OF) and (why := unavailable(args.model)):
        print(why, file=sys.stderr)
        methods = [m for m in methods if m not in LLAMA_CPP_OF]
    quiet_transformers()
    loaded = load_model(args.model)
    if args.direct_only:
        print_direct_costs(loaded, args)
        return 0
    warm = encode_prompt(loaded, "Hello")
    loaded.model.generate(torch.tensor([warm]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    llama = LlamaCppPeers([LLAMA_CPP_OF[m] for m in methods if m in LLAMA_CPP_OF], loaded, torch.get_num_threads())
    with llama:
        rows, raw = interleaved(loaded, dict(list(PROMPTS.items())[: args.prompts]), methods, args, llama)
        peer_machine = llama.machine() if llama.names else None
    print_table(rows, args, methods, peer_machine)
    per_token, step = tracing_cost(loaded)
    print(
        f"\ntracing cost measured directly: {per_token * 1e6:.0f} µs per token (target probability + token text) "
        f"against a {step * 1e3:.1f} ms one-token step = {per_token / step:.2%}"
    )
    if args.out:
        machine = machine_info() | ({"peers": {"llama.cpp": peer_machine}} if peer_machine else {})
        record = {"args": vars(args) | {"out": str(args.out)}, "machine": machine, "results": raw}
        args.out.write_text(json.dumps(record, indent=1))
    return 0


def interleaved(
    loaded, prompts: dict[str, str], methods: list[str], args, llama: LlamaCppPeers
) -> tuple[list[tuple], dict[str, dict]]:
    """Every method on each prompt `args.repeats` times, round-robin (args: model, weights,
    max_new_tokens, repeats); ours_ar must be among them. Returns the rows print_table prints
    (prompt, prompt tokens, new tokens, best tokens/s by method, identical, llama.cpp's parting)
    and the raw record by prompt. A llama.cpp method whose process dies is left out from there on."""
    rows, raw = [], {}
    failed: set[str] = set()  # llama.cpp peers whose process died or hung
    for name, prompt in prompts.items():
        prompt_ids = encode_prompt(loaded, prompt)
        rates: dict[str, list[float]] = {m: [] for m in methods}
        outputs: dict[str, list[int]] = {}
        for r in range(args.repeats):
            for method in [m for m in methods if m not in failed]:
                if method.startswith("ours"):
                    out, wall = ours(args.model, prompt, args.max_new_tokens, method, args.weights)
                elif method in LLAMA_CPP_OF:
                    try:
                        run_ = llama.run(LLAMA_CPP_OF[method], prompt_ids, args.max_new_tokens)
                    except PeerFailed as e:  # its process died or hung: one line, the rest goes on
                        print(f"{e}; {method} left out from here on", file=sys.stderr)
                        failed.add(method)
                        continue
                    out, wall = run_.output_token_ids, run_.wall_time_s
                else:
                    out, wall = hf(loaded, prompt_ids, args.max_new_tokens, method)
                rates[method].append(len(out) / wall)
                outputs[method] = out
            print(
                f"  {time.strftime('%H:%M:%S')} {name}: repeat {r + 1}/{args.repeats} done",
                file=sys.stderr,
                flush=True,
            )
        best = {m: max(v) for m, v in rates.items() if v}
        # every method on the same weights as ours: transformers' run fp32, so in another format only ours count
        alike = [m for m in outputs if m not in LLAMA_CPP_OF and (m.startswith("ours") or args.weights == FP32)]
        identical = all(outputs[m] == outputs["ours_ar"] for m in alike)
        same = {
            m: parting(loaded.model, prompt_ids, outputs["ours_ar"], outputs[m]) for m in LLAMA_CPP_OF if m in outputs
        }
        if set(LLAMA_CPP_OF) <= set(outputs):  # llama.cpp's own speculation against its own plain decoding
            same["pld_vs_llama_cpp_ar"] = first_divergence(outputs["llama_cpp_ar"], outputs["llama_cpp_pld"])
        raw[name] = {
            "prompt_tokens": len(prompt_ids),
            "new_tokens": len(outputs["ours_ar"]),
            "tokens_per_s": rates,
            "llama_cpp_parting": same,
            "outputs": outputs,
        }
        rows.append((name, len(prompt_ids), len(outputs["ours_ar"]), best, identical, same))
    return rows, raw


def print_table(rows, args, methods: list[str], peer_machine: dict | None = None) -> None:
    beside = f", beside {describe_peer(peer_machine)} on {peer_machine['gguf']}" if peer_machine else ""
    print(
        f"\n{args.model} (ours: {args.weights} weights), greedy, max_new_tokens={args.max_new_tokens}, "
        f"best of {args.repeats} interleaved runs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine_label(machine_info())} "
        f"(torch {torch.__version__}){beside}\n"
    )
    columns = {
        "ours AR tok/s": lambda m: f"{m['ours_ar']:.1f}",
        "HF plain tok/s": lambda m: f"{m['hf_plain']:.1f}",
        "HF static+compile tok/s": lambda m: f"{m['hf_static_compile']:.1f}",
        "ours AR / HF plain": lambda m: f"{m['ours_ar'] / m['hf_plain']:.2f}x",
        "ours AR / HF static+compile": lambda m: f"{m['ours_ar'] / m['hf_static_compile']:.2f}x",
        "ours compiled / ours": lambda m: f"{m['ours_ar_compiled'] / m['ours_ar']:.2f}x",
        "lean / transformers forward": lambda m: f"{m['ours_ar'] / m['ours_ar_transformers_forward']:.2f}x",
        "ours PLD / HF PLD": lambda m: f"{m['ours_pld'] / m['hf_pld']:.2f}x",
        "ours PLD / ours AR": lambda m: f"{m['ours_pld'] / m['ours_ar']:.2f}x",
        "PLD no match / AR": lambda m: f"{m['ours_pld_nomatch'] / m['ours_ar']:.2f}x",
        "tracing overhead": lambda m: f"{1 - m['ours_ar'] / m['ours_ar_minimal']:+.1%}",
    }
    llama = set(methods) & set(LLAMA_CPP_OF)
    if llama:
        columns |= {
            "llama.cpp AR tok/s": lambda m: f"{m['llama_cpp_ar']:.1f}",
            "llama.cpp PLD tok/s": lambda m: f"{m['llama_cpp_pld']:.1f}",
            "ours AR / llama.cpp AR": lambda m: f"{m['ours_ar'] / m['llama_cpp_ar']:.2f}x",
            "ours PLD / llama.cpp PLD": lambda m: f"{m['ours_pld'] / m['llama_cpp_pld']:.2f}x",
            "llama.cpp PLD / llama.cpp AR": lambda m: f"{m['llama_cpp_pld'] / m['llama_cpp_ar']:.2f}x",
        }
    same_weights = "identical" if args.weights == FP32 else "identical (ours; HF runs fp32)"
    head = "| prompt | prompt tok | new tok | " + " | ".join(columns) + f" | {same_weights} |"
    head += " llama.cpp tokens = ours AR |" if llama else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, n_prompt, n_new, m, identical, same in rows:
        cells = " | ".join(cell(f, m) for f in columns.values())
        tail = f" {agreement(same)} |" if llama else ""
        print(f"| {name} | {n_prompt} | {n_new} | {cells} | {'yes' if identical else 'NO'} |{tail}")


def agreement(parted: dict) -> str:
    """ "yes", or where llama.cpp's greedy tokens first differ from ours and by how many logits our
    model preferred its own token there ("ar from 11 (0.20)"), and where its prompt lookup's differ
    from its own plain decoding ("pld vs llama.cpp ar from 13")."""
    if not parted:
        return "—"
    if all(d is None for d in parted.values()):
        return "yes"
    cells = []
    for method, d in parted.items():
        if isinstance(d, tuple):
            cells.append(f"{method.removeprefix('llama_cpp_')} from {d[0]} ({d[1]:.2f})")
        elif d is not None:
            cells.append(f"pld vs llama.cpp ar from {d}")
    return ", ".join(cells)


def cell(column, best: dict[str, float]) -> str:
    try:
        return column(best)
    except KeyError:  # a method left out by --methods
        return "—"


if __name__ == "__main__":
    sys.exit(main())
