"""`run`: decode one prompt with one strategy and write its trace; `check-distribution`: sample
with autoregressive decoding and with a strategy, and test that they agree."""

import argparse
import json
import sys
from pathlib import Path

from mtp_viz.cli.options import add_backend, add_compile, add_weights, given
from mtp_viz.errors import UserError
from mtp_viz.machine import describe
from mtp_viz.quality import check_distribution
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.backend import BACKEND_VLLM, run_vllm
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.variants import parse_variant


def add(sub) -> None:
    p = sub.add_parser("run", help="decode one prompt with one strategy and write its trace")
    _add_request(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--trace-out", type=Path, help="where to write the trace JSON")
    p.add_argument("--record", choices=("full", "minimal"), default="full")
    add_backend(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("check-distribution", help="sample K times with AR and with a strategy; test they agree")
    _add_request(p)
    p.add_argument("--tokens", type=int, default=2, help="tokens sampled per run")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_check_distribution)


def _add_request(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--eagle3", help="EAGLE-3 drafter (eagle): registry id or directory (default: the model's first)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    add_compile(p)
    add_weights(p)


def _request(args: argparse.Namespace, max_new_tokens: int, default_temperature: float) -> RunRequest:
    _, strategy_settings = parse_variant(":".join([args.strategy, *args.set]))
    strategy_settings.update(given(args, "num_draft_tokens", "max_ngram_size", "min_ngram_size"))
    temperature = default_temperature if args.temperature is None else args.temperature
    return RunRequest(
        **given(
            args,
            "prompt",
            "model",
            "strategy",
            "draft",
            "heads",
            "eagle3",
            "raw",
            "device",
            "dtype",
            "compile",
            "weights",
        ),
        generation=GenerationSettings(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        ),
        strategy_settings=strategy_settings,
        record=getattr(args, "record", "full"),
    )


def _progress_line(message: str) -> None:
    """One status line, rewritten in place on a terminal (server start-up)."""
    if sys.stderr.isatty():
        print(f"\r{message[:150]:<150}", end="", file=sys.stderr, flush=True)
    elif message.startswith("vLLM ") or "(0 s)" in message:
        print(message, file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> None:
    request = _request(args, args.max_new_tokens, 0.0)
    if args.backend == BACKEND_VLLM:
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
    if trace.machine.get("served_note"):
        print(f"  served: {trace.machine['served_note']}")
    print(f"  machine: {describe(trace.machine)}")
    print(trace.output_text)
    if args.trace_out:
        trace.save(args.trace_out)
        print(f"trace written to {args.trace_out}")


def cmd_check_distribution(args: argparse.Namespace) -> None:
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
