"""Command line: `python -m mtp_viz run|check-distribution ...`."""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from mtp_viz.errors import UserError
from mtp_viz.peers import PEERS
from mtp_viz.profile import BATCH_SIZES
from mtp_viz.runner import COMPILE_CHOICES
from mtp_viz.serving.backend import BACKEND_OURS, BACKEND_VLLM, BACKENDS
from mtp_viz.serving.load import CONCURRENCY
from mtp_viz.serving.peers import VLLM_PEERS
from mtp_viz.strategies import STRATEGIES

DEBUG_ENV = "MTP_VIZ_DEBUG"
COMPILE_HELP = "torch.compile the lean forward: auto (on a GPU), on, off; compiled once, outside the timing"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="registry id or local model directory (default: the device's default)")
    p.add_argument("--draft", help="draft model: registry id or local directory")
    p.add_argument("--strategy", default="autoregressive", help=f"one of: {', '.join(STRATEGIES)}")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="feed the prompt without the chat template")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-draft-tokens", type=int, help="tokens drafted per step (speculative, prompt_lookup)")
    p.add_argument("--max-ngram-size", type=int, help="longest n-gram matched (prompt_lookup)")
    p.add_argument("--min-ngram-size", type=int, help="shortest n-gram matched (prompt_lookup)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any strategy setting, e.g. --set tree=chain --set tau=0.8 (README lists them)",
    )
    p.add_argument("--heads", help="MTP heads: registry id or directory (default: the model's first registered)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m mtp_viz", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="decode one prompt with one strategy and write its trace")
    _add_common(run)
    run.add_argument("--max-new-tokens", type=int, default=128)
    run.add_argument("--trace-out", type=Path, help="where to write the trace JSON")
    run.add_argument("--record", choices=("full", "minimal"), default="full")
    _add_backend(run)
    dist = sub.add_parser("check-distribution", help="sample K times with AR and with a strategy; test they agree")
    _add_common(dist)
    dist.add_argument("--tokens", type=int, default=2, help="tokens sampled per run")
    dist.add_argument("--samples", type=int, default=200)
    dist.add_argument("--out", type=Path, required=True)
    bench = sub.add_parser("bench", help="run strategies over a prompt suite; tables, CSV, JSON and traces")
    bench.add_argument("--suite", default="spec-bench")
    bench.add_argument("--categories", help="comma-separated, default: all")
    bench.add_argument("--limit", type=int, help="prompts per category")
    bench.add_argument(
        "--strategies",
        default="autoregressive,prompt_lookup",
        help="comma-separated; a variant sets values: mtp_heads:tree=0,1,00:acceptance=typical",
    )
    bench.add_argument("--model")
    bench.add_argument("--draft")
    bench.add_argument("--heads", help="MTP heads: registry id or directory (default: the model's first registered)")
    bench.add_argument("--num-draft-tokens", type=int)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--device", default="auto")
    bench.add_argument("--dtype", default="auto")
    bench.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)
    bench.add_argument(
        "--peers",
        default="",
        help="other engines on the same prompts in the same run, comma-separated: transformers' "
        + ", ".join(PEERS)
        + "; a vLLM server per served strategy (needs .venv-vllm): "
        + ", ".join(VLLM_PEERS),
    )
    bench.add_argument("--out", type=Path, required=True)
    _add_backend(bench)
    bench.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="vllm backend: concurrent clients, comma-separated (a closed loop per level)",
    )
    bench.add_argument(
        "--profile",
        type=Path,
        help="vllm backend: a profile with B × k timings; its predicted speedup goes beside the measured one",
    )
    bench.add_argument(
        "--compare-ours",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vllm backend: also run our engine on the same prompts (after the servers stop): engines.csv",
    )
    prof = sub.add_parser("profile", help="measure the verify-cost curve (and draft cost ratio c) on this device")
    prof.add_argument("--model", help="registry id or local model directory (default: the device's default)")
    prof.add_argument("--draft", help="draft model, to measure c")
    prof.add_argument("--max-k", type=int, default=32)
    prof.add_argument("--repeats", type=int, default=5)
    prof.add_argument("--device", default="auto")
    prof.add_argument("--dtype", default="auto")
    prof.add_argument(
        "--exit-prompts",
        type=int,
        default=3,
        help="Spec-Bench prompts whose greedy answers measure early-exit agreement per layer (0: skip)",
    )
    prof.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="concurrent sequences B for the B × k timings behind the Deploy view's load curve (empty: skip)",
    )
    prof.add_argument("--out", type=Path, required=True)
    _add_train(sub)
    export = sub.add_parser(
        "export-draft", help="write a trained draft as a plain model directory another engine (vLLM) loads"
    )
    export.add_argument("--draft", required=True, help="registry id of a trained draft (e.g. smollm2-135m-draft)")
    export.add_argument("--out", type=Path, help="where (default: <cache>/export/<draft>)")
    return parser


def _add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=BACKEND_OURS,
        help="mtp-viz (our instrumented engine) or vllm (a vLLM server started in .venv-vllm, or --vllm-url)",
    )
    p.add_argument("--vllm-url", help="use the vLLM server already running at this URL instead of starting one")


def _progress_line(message: str) -> None:
    """One status line, rewritten in place on a terminal (server start-up)."""
    if sys.stderr.isatty():
        print(f"\r{message[:150]:<150}", end="", file=sys.stderr, flush=True)
    elif message.startswith("vLLM ") or "(0 s)" in message:
        print(message, file=sys.stderr)


def _add_train(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train drafters for a frozen target: data (cached self-distillation set), draft (a small draft model), "
        "heads (sequential MTP heads), mtp (a mask-token MTP adapter, by self-distillation)",
    )
    t.add_argument("what", choices=("data", "draft", "heads", "mtp"))
    t.add_argument("--model", help="the frozen target (default: the device's default)")
    t.add_argument("--data", type=Path, help="data folder (default: <cache>/train/<model>)")
    t.add_argument("--out", type=Path, help="where the trained draft, heads or adapter go (required but for data)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint (kept beside the data)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--start-from", type=Path, help="draft/heads/mtp: continue training these saved weights")
    t.add_argument("--instructions", type=int, help="data: round-1 prompts")
    t.add_argument("--self-instruct", type=int, help="data: round-2 prompts, written by the target itself")
    t.add_argument("--contexts", type=int, help="data: round-3 (summarise / context QA) prompts")
    t.add_argument("--math", type=int, help="data: round-4 prompts (word problems, step by step)")
    t.add_argument("--max-new-tokens", type=int, help="data: tokens generated per prompt")
    t.add_argument("--batch-size", type=int, help="data: prompts decoded together")
    t.add_argument("--layers", type=int, help="draft: decoder layers")
    t.add_argument("--depth", type=int, help="heads: depths unrolled in training")
    t.add_argument("--vocab", type=int, help="reduced vocabulary size")
    t.add_argument("--k-max", type=int, help="mtp: most predictions per forward trained (1 + masks)")
    t.add_argument("--rank", type=int, help="mtp: LoRA rank")
    t.add_argument("--gating", help="mtp: adapter at mask positions only (mask_only) or everywhere")
    t.add_argument("--steps", type=int, help="mtp: optimizer steps (the training budget)")
    t.add_argument("--epochs", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--device", default="cpu")


def _cmd_bench(args) -> None:
    from tqdm import tqdm

    from mtp_viz.bench import load_suite, run_bench, save
    from mtp_viz.models import load_model
    from mtp_viz.runner import RunRequest, settings_of, split_variants
    from mtp_viz.strategies.base import GenerationSettings

    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    categories = [c for c in (args.categories or "").split(",") if c] or None
    prompts = load_suite(args.suite, categories, args.limit)
    strategies = split_variants(args.strategies)
    base = RunRequest(
        model=args.model,
        draft=args.draft,
        heads=args.heads,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
    )

    def settings_for(strategy: str) -> dict:
        return settings_of(strategy, {"num_draft_tokens": args.num_draft_tokens})

    if args.backend == BACKEND_VLLM:
        return _bench_vllm(args, prompts, strategies, base, settings_for)
    if args.vllm_url:
        raise UserError("--vllm-url needs --backend vllm")
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
    from tqdm import tqdm

    from mtp_viz.profile import read_batch_profile
    from mtp_viz.serving.load import LEVEL_DONE, compare_engines, sweep

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency takes integers separated by commas, got {args.concurrency!r}") from None
    if args.peers:
        raise UserError("--peers run beside our engine; with --backend vllm leave them out")
    profile = read_batch_profile(args.profile)[:2] if args.profile else None
    labels = len(dict.fromkeys([*strategies] if args.vllm_url else ["autoregressive", *strategies]))
    with tqdm(total=labels * len(levels), unit="level") as bar:

        def progress(message: str) -> None:
            bar.set_description_str(message[:80])
            bar.update(int(message.startswith(LEVEL_DONE)))

        table = sweep(prompts, strategies, levels, base, args.out, settings_for, args.vllm_url, progress, profile)
    shown = ["strategy", "concurrency", "tokens_per_s", "speedup", "predicted_speedup", "mean_accepted_tokens"]
    shown += ["identical_to_ar", "ttft_s", "itl_s"]
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.compare_ours:
        engines = compare_engines(prompts, strategies, base, args.out, settings_for)
        print(engines.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"serving.csv, summary.json and traces written to {args.out}")


def _cmd_profile(args) -> None:
    from dataclasses import replace

    from mtp_viz.models import load_model, resolve_device
    from mtp_viz.profile import exit_agreement, profile
    from mtp_viz.registry import load_registry

    if not 1 <= args.max_k <= 256 or not 1 <= args.repeats <= 100:
        raise UserError("--max-k must be 1..256 and --repeats 1..100")
    name = args.model or load_registry().default_for(resolve_device(args.device).type)
    target = load_model(name, args.device, args.dtype)
    draft = load_model(args.draft, args.device, args.dtype) if args.draft else None
    if not 0 <= args.exit_prompts <= 50:
        raise UserError("--exit-prompts must be 0..50")
    try:
        sizes = tuple(int(b) for b in args.batch_sizes.split(",") if b.strip())
    except ValueError:
        raise UserError(f"--batch-sizes takes integers separated by commas, got {args.batch_sizes!r}") from None
    if any(not 1 <= b <= 256 for b in sizes):
        raise UserError("--batch-sizes must be 1..256")
    result = profile(target, draft, max_k=args.max_k, repeats=args.repeats, batch_sizes=sizes)
    if args.exit_prompts:
        answers = _answers(name, args.exit_prompts, args.device, args.dtype)
        result = replace(result, exit_agreement=exit_agreement(target.model, answers))
    args.out.write_text(json.dumps(result.as_dict(), indent=1))
    curve = ", ".join(f"{k}: {v:.2f}" for k, v in result.verify_cost.items() if k in (1, 2, 4, 8, 16, 32))
    print(f"{result.model} on {result.device} ({result.dtype}): one-token forward {result.one_token_s * 1e3:.1f} ms")
    print(f"verify cost relative to one token (k: x): {curve}")
    if result.c is not None:
        print(f"draft {result.draft_model}: c = {result.c:.3f}")
    if result.exit_agreement:
        shown = ", ".join(f"{k}: {v:.2f}" for k, v in result.exit_agreement.items())
        print(f"early exit after layer L agrees with the model's next token (L: share): {shown}")
    print(f"written to {args.out}")


def _answers(model: str, n: int, device: str, dtype: str) -> list[tuple[list[int], int]]:
    """Greedy answers (48 tokens) of `model` (as the user named it: a registry id or a directory,
    which the runner loads from the same process cache) to the first prompt of n Spec-Bench
    categories."""
    from mtp_viz.prompts import spec_bench
    from mtp_viz.runner import RunRequest, run
    from mtp_viz.strategies.base import GenerationSettings

    firsts = {}
    for q in spec_bench():
        firsts.setdefault(q["category"], q["turns"][0])
    out = []
    for text in list(firsts.values())[:n]:
        request = RunRequest(
            prompt=text, model=model, device=device, dtype=dtype, generation=GenerationSettings(max_new_tokens=48)
        )
        t = run(request)
        out.append((t.prompt_token_ids + t.output_token_ids, len(t.prompt_token_ids)))
    return out


def _cmd_train(args) -> None:
    from dataclasses import replace

    from mtp_viz.models import cache_root, load_model
    from mtp_viz.registry import load_registry
    from mtp_viz.training.data import MANIFEST, DataConfig, generate
    from mtp_viz.training.draft import DraftTrainConfig, train_draft
    from mtp_viz.training.heads import HeadsTrainConfig, train_heads
    from mtp_viz.training.mask import MaskTrainConfig, train_mask

    given = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731
    loop = given(epochs=args.epochs, lr=args.lr)
    if args.what != "data" and args.out is None:
        raise UserError(f"train {args.what} needs --out DIR")
    if args.what == "mtp":  # settings checked before anything loads
        defaults = MaskTrainConfig()
        mask_loop = replace(defaults.loop, seed=args.seed, **loop, **given(max_steps=args.steps))
        mask_cfg = MaskTrainConfig(**given(k_max=args.k_max, rank=args.rank, gating=args.gating), loop=mask_loop)
    name = args.model or load_registry().default_for(args.device)
    target = load_model(name, args.device, "float32")
    data = args.data or cache_root() / "train" / target.name
    data_flags = given(
        instructions=args.instructions,
        self_instruct=args.self_instruct,
        contexts=args.contexts,
        math=args.math,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    if args.what != "data" and not data_flags and not (data / MANIFEST).is_file():
        raise UserError(f"no training data in {data}; make it first: python -m mtp_viz train data --data {data}")
    # Without data flags an existing folder keeps its own settings (and is only finished if incomplete).
    generate(target, data, DataConfig(**data_flags, seed=args.seed) if data_flags else None)
    if args.what == "data":
        return
    runs = data / "runs" / args.out.name
    if args.what == "draft":
        cfg = DraftTrainConfig(**given(layers=args.layers, reduced_vocab=args.vocab))
        cfg = replace(cfg, loop=replace(cfg.loop, seed=args.seed, **loop))
        report = train_draft(target, data, args.out, cfg, args.resume, runs=runs, start_from=args.start_from)
    elif args.what == "heads":
        cfg = HeadsTrainConfig(**given(depth=args.depth, reduced_vocab=args.vocab))
        cfg = replace(cfg, loop=replace(cfg.loop, seed=args.seed, **loop))
        report = train_heads(target, data, args.out, cfg, args.resume, runs=runs, start_from=args.start_from)
    else:
        report = train_mask(target, data, args.out, mask_cfg, args.resume, runs=runs, start_from=args.start_from)
    final = report["history"][-1] if report["history"] else report["before"]
    print(f"{args.what} trained in {report['seconds']:.0f} s and saved to {args.out}: {final}")


def _request(args, max_new_tokens: int, default_temperature: float):
    from mtp_viz.runner import RunRequest, parse_variant
    from mtp_viz.strategies.base import GenerationSettings

    _, strategy_settings = parse_variant(":".join([args.strategy, *args.set]))
    for name in ("num_draft_tokens", "max_ngram_size", "min_ngram_size"):
        if getattr(args, name) is not None:
            strategy_settings[name] = getattr(args, name)
    temperature = default_temperature if args.temperature is None else args.temperature
    return RunRequest(
        prompt=args.prompt,
        model=args.model,
        strategy=args.strategy,
        draft=args.draft,
        heads=args.heads,
        raw=args.raw,
        generation=GenerationSettings(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        ),
        strategy_settings=strategy_settings,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        record=getattr(args, "record", "full"),
    )


def _cmd_run(args) -> None:
    from mtp_viz.machine import describe
    from mtp_viz.runner import run

    request = _request(args, args.max_new_tokens, 0.0)
    if args.backend == BACKEND_VLLM:
        from mtp_viz.serving.backend import run_vllm

        trace = run_vllm(request, args.vllm_url, progress=_progress_line)
        if sys.stderr.isatty():
            print(file=sys.stderr)
    else:
        if args.vllm_url:
            raise UserError("--vllm-url needs --backend vllm")
        trace = run(request)
    s = trace.summary
    draft = f" + draft {trace.draft_model}" if trace.draft_model else ""
    print(f"{trace.strategy} on {trace.model}{draft} ({trace.device}, {trace.dtype})")
    print(
        f"  {s['new_tokens']} tokens in {s['wall_time_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s, "
        f"{s['target_forwards']} target forwards, mean accepted tokens {s['mean_accepted_tokens']:.2f}"
    )
    if s["drafted_tokens"]:
        print(f"  acceptance {s['acceptance_rate']:.1%} of {s['drafted_tokens']} drafted tokens")
    print(f"  stop: {trace.stop_reason}")
    print(f"  machine: {describe(trace.machine)}")
    print(trace.output_text)
    if args.trace_out:
        trace.save(args.trace_out)
        print(f"trace written to {args.trace_out}")


def _cmd_export_draft(args) -> None:
    from mtp_viz.serving.export import export_draft

    print(f"{args.draft} written to {export_draft(args.draft, args.out)} (vLLM: --speculative-config model=<that>)")


def _cmd_check_distribution(args) -> None:
    from mtp_viz.quality import check_distribution

    if args.samples < 2 or args.samples > 100_000:
        raise UserError("--samples must be between 2 and 100000")
    result = check_distribution(_request(args, args.tokens, 1.0), args.samples)
    args.out.write_text(json.dumps(result, indent=1))
    v = result["verdict"]
    for name, t in v["first_token_vs_exact"].items():
        print(f"first token, {name} vs exact target distribution: p = {t['p_value']:.3g} ({t['verdict']})")
    if "sequences_two_sample" in v:
        t = v["sequences_two_sample"]
        print(f"first {args.tokens} tokens, autoregressive vs {args.strategy}: p = {t['p_value']:.3g} ({t['verdict']})")
    print(f"verdict: {v['overall']}; samples written to {args.out}")


def main(argv: list[str] | None = None) -> int:
    from mtp_viz.models import quiet_transformers

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet_transformers()
    args = _parser().parse_args(argv)
    try:
        commands = {
            "run": _cmd_run,
            "check-distribution": _cmd_check_distribution,
            "profile": _cmd_profile,
            "bench": _cmd_bench,
            "train": _cmd_train,
            "export-draft": _cmd_export_draft,
        }
        commands[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not bad input: one line, the traceback on request
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"internal error: {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
