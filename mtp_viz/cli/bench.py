"""`bench`: strategies over a prompt suite on our engine (tables, CSV, JSON and traces, beside
peers if asked), or on a vLLM server under load."""

import argparse
from pathlib import Path

from tqdm import tqdm

from mtp_viz.bench import load_suite, run_bench, save
from mtp_viz.cli.options import add_backend, add_compile, add_weights, given
from mtp_viz.errors import UserError
from mtp_viz.llama_peers import INSTALL as LLAMA_CPP_INSTALL
from mtp_viz.llama_peers import LLAMA_CPP_PEERS
from mtp_viz.loading import load_model
from mtp_viz.peers import PEERS
from mtp_viz.profile import read_profile
from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import BACKEND_VLLM
from mtp_viz.serving.engines import compare_engines
from mtp_viz.serving.peers import VLLM_PEERS
from mtp_viz.serving.scheduled import AUTO
from mtp_viz.serving.sweep import CONCURRENCY, LEVEL_DONE, read_sweep, sweep
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.variants import settings_of, split_variants


def add(sub) -> None:
    p = sub.add_parser("bench", help="run strategies over a prompt suite; tables, CSV, JSON and traces")
    p.add_argument(
        "--suite",
        default="spec-bench",
        help="spec-bench (the shipped questions), or a file of your own prompts: Spec-Bench's JSONL "
        '(one {"question_id", "category", "turns": ["prompt", ...]} a line; the first turn is the prompt) '
        'or plain text, one prompt a line (category "custom")',
    )
    p.add_argument("--categories", help="comma-separated, default: all")
    p.add_argument("--limit", type=int, help="prompts per category")
    p.add_argument(
        "--strategies",
        default="autoregressive,prompt_lookup",
        help="comma-separated; a variant sets values: mtp_heads:tree=0,1,00:acceptance=typical",
    )
    p.add_argument("--model")
    p.add_argument("--draft")
    p.add_argument("--heads", help="MTP heads: registry id or directory (default: the model's first registered)")
    p.add_argument("--eagle3", help="EAGLE-3 drafter (eagle): registry id or directory (default: the model's first)")
    p.add_argument("--num-draft-tokens", type=int)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    add_compile(p)
    add_weights(p)
    p.add_argument(
        "--peers",
        default="",
        help="other engines on the same prompts in the same run, comma-separated: transformers' "
        + ", ".join(PEERS)
        + "; a vLLM server per served strategy (needs .venv-vllm): "
        + ", ".join(VLLM_PEERS)
        + f"; llama.cpp on the model's shipped GGUF (needs {LLAMA_CPP_INSTALL}; skipped without it): "
        + ", ".join(LLAMA_CPP_PEERS),
    )
    p.add_argument("--out", type=Path, required=True)
    add_backend(p)
    p.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="vllm backend: concurrent clients, comma-separated (a closed loop per level)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="vllm backend: a profile with B × k timings (profile --backend vllm); its predicted speedup goes "
        "beside the measured one (with --schedule auto and none given: this machine's, measured once and cached)",
    )
    p.add_argument(
        "--schedule",
        help="vllm backend: also serve each speculative strategy with a draft length per concurrency: "
        "`auto` (recommended from the profile and the acceptance its longest fixed variant measured here; "
        "every shorter fixed length is measured too, and the recommended configuration, plain serving where "
        "speculation stops paying, gets rows of its own) "
        "or a table, e.g. 1-2:3,3-32:0 (batch from-to: draft tokens; vLLM's num_speculative_tokens_per_batch_size)",
    )
    p.add_argument(
        "--compare-ours",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vllm backend: also run our engine on the same prompts (after the servers stop): engines.csv",
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    categories = [c for c in (args.categories or "").split(",") if c] or None
    prompts = load_suite(args.suite, categories, args.limit)
    strategies = split_variants(args.strategies)
    base = RunRequest(
        **given(args, "model", "draft", "heads", "eagle3", "device", "dtype", "compile", "weights"),
        generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
    )

    def settings_for(strategy: str) -> dict:
        return settings_of(strategy, {"num_draft_tokens": args.num_draft_tokens})

    if args.backend == BACKEND_VLLM:
        return _bench_vllm(args, prompts, strategies, base, settings_for)
    if args.vllm_url or args.schedule:
        raise UserError("--vllm-url and --schedule need --backend vllm")
    peers = [p for p in args.peers.split(",") if p]
    bars = []  # opened at the first finished run, so that an error before it prints alone

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="run"))
        bars[0].update(1)

    try:
        traces, peer_runs = run_bench(prompts, strategies, base, settings_for, progress=progress, peers=peers)
    finally:
        for bar in bars:
            bar.close()
    scorer = load_model(traces["autoregressive"][0].model, args.device, args.dtype).model  # the original model
    summary = save(args.out, prompts, traces, peer_runs, scorer)
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"results, summary and traces written to {args.out}")


def _bench_vllm(args, prompts, strategies, base, settings_for) -> None:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency takes integers separated by commas, got {args.concurrency!r}") from None
    if args.peers:
        raise UserError("--peers run beside our engine; with --backend vllm leave them out")
    profile = read_profile(args.profile) if args.profile else None
    labels = len(dict.fromkeys([*strategies] if args.vllm_url else ["autoregressive", *strategies]))
    if args.schedule:  # one scheduled variant per speculative strategy
        labels += len({s.partition(":")[0] for s in strategies} - {"autoregressive"})
    total = None if args.schedule == AUTO else labels * len(levels)  # auto adds fixed lengths (and a profile)
    with tqdm(total=total, unit="level") as bar:

        def progress(message: str) -> None:
            bar.set_description_str(message[:80])
            bar.update(int(message.startswith(LEVEL_DONE)))

        table = sweep(
            prompts, strategies, levels, base, args.out, settings_for, args.vllm_url, progress, profile, args.schedule
        )
    shown = ["strategy", "concurrency", "tokens_per_s", "speedup", "predicted_speedup", "mean_accepted_tokens"]
    shown += ["identical_to_ar", "ttft_s", "itl_s"]
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for label, schedule in read_sweep(args.out)[1].get("schedules", {}).items():
        stop = schedule["crossover"]
        print(
            f"{label}: num_speculative_tokens_per_batch_size {schedule['num_speculative_tokens_per_batch_size']}; "
            + (f"speculation off from {stop} sequences" if stop else "speculating at every concurrency")
            + ("" if schedule["served"] else " (never drafts: not served, plain decoding's rows measure it)")
        )
        if schedule.get("recommended"):
            plain = schedule.get("plain_from")
            if plain == 1:
                what = "plain serving (no speculative config) at every concurrency"
            elif plain:
                what = f"this table below {plain} sequences, plain serving (no speculative config) from {plain}"
            else:
                what = "this table at every concurrency"
            print(f"recommended ({schedule['recommended']}): {what}")
    if args.compare_ours:
        engines = compare_engines(prompts, strategies, base, args.out, settings_for)
        print(engines.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"serving.csv, summary.json and traces written to {args.out}")
