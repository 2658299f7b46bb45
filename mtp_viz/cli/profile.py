"""`profile`: measure, on this device, the verify-cost curve, the draft cost ratio c, early-exit
agreement per layer and the B × k timings behind the Deploy view's load curve."""

import argparse
import json
from dataclasses import replace
from pathlib import Path

from mtp_viz.bench import load_suite
from mtp_viz.cli.options import add_backend, add_weights, given
from mtp_viz.errors import UserError
from mtp_viz.loading import load_model, model_name
from mtp_viz.profile import BATCH_SIZES, exit_agreement, profile
from mtp_viz.prompts import spec_bench
from mtp_viz.runner import RunRequest, run
from mtp_viz.served_costs import parse_served
from mtp_viz.serving.backend import BACKEND_VLLM
from mtp_viz.serving.engine_profile import SERVED_TOKENS, engine_profile
from mtp_viz.strategies.base import GenerationSettings


def add(sub) -> None:
    p = sub.add_parser("profile", help="measure the verify-cost curve (and draft cost ratio c) on this device")
    p.add_argument("--model", help="registry id or local model directory (default: the device's default)")
    p.add_argument("--draft", help="draft model, to measure c")
    p.add_argument("--max-k", type=int, default=32)
    p.add_argument("--repeats", type=int, help="rounds of timings (default: 5 on our engine, 1 on vLLM)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--exit-prompts",
        type=int,
        default=3,
        help="Spec-Bench prompts whose greedy answers measure early-exit agreement per layer (0: skip)",
    )
    p.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="concurrent sequences B for the B × k timings behind the Deploy view's load curve (empty: skip)",
    )
    p.add_argument(
        "--eagle3", help="vllm backend: also measure this EAGLE-3 drafter's cost per B (default: not measured)"
    )
    p.add_argument(
        "--served",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vllm backend: also time every server as a sweep serves it (closed-loop clients with real prompts, "
        "prefills mixed in, each drafter's prefill; a plain server beside): what the prediction and the "
        "recommendation read",
    )
    p.add_argument("--suite", default="spec-bench", help="vllm backend, served: the prompts (as bench --suite)")
    p.add_argument("--categories", help="vllm backend, served: comma-separated, default: all")
    p.add_argument("--limit", type=int, default=1, help="vllm backend, served: prompts per category")
    p.add_argument(
        "--served-tokens", type=int, default=SERVED_TOKENS, help="vllm backend, served: tokens each request decodes"
    )
    add_weights(p)
    add_backend(p)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> None:
    if args.backend == BACKEND_VLLM:
        return _profile_vllm(args)
    if args.vllm_url or args.eagle3:
        raise UserError("--vllm-url and --eagle3 need --backend vllm")
    args.repeats = 5 if args.repeats is None else args.repeats
    if not 1 <= args.max_k <= 256 or not 1 <= args.repeats <= 100:
        raise UserError("--max-k must be 1..256 and --repeats 1..100")
    name = model_name(args.model, args.device)
    target = load_model(name, args.device, args.dtype, args.weights)
    draft = load_model(args.draft, args.device, args.dtype, target.weights) if args.draft else None
    if not 0 <= args.exit_prompts <= 50:
        raise UserError("--exit-prompts must be 0..50")
    sizes = _sizes(args.batch_sizes)
    result = profile(target, draft, max_k=args.max_k, repeats=args.repeats, batch_sizes=sizes)
    if args.exit_prompts:
        answers = _answers(name, args.exit_prompts, args.device, args.dtype)
        result = replace(result, exit_agreement=exit_agreement(target.model, answers))
    args.out.write_text(json.dumps(result.as_dict(), indent=1))
    curve = ", ".join(f"{k}: {v:.2f}" for k, v in result.verify_cost.items() if k in (1, 2, 4, 8, 16, 32))
    print(
        f"{result.model} on {result.device} ({result.dtype}, weights {target.weights}): "
        f"one-token forward {result.one_token_s * 1e3:.1f} ms"
    )
    print(f"verify cost relative to one token (k: x): {curve}")
    if result.c is not None:
        print(f"draft {result.draft_model}: c = {result.c:.3f}")
    if result.exit_agreement:
        shown = ", ".join(f"{k}: {v:.2f}" for k, v in result.exit_agreement.items())
        print(f"early exit after layer L agrees with the model's next token (L: share): {shown}")
    print(f"written to {args.out}")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise UserError(f"--batch-sizes takes integers separated by commas, got {text!r}") from None
    if any(not 1 <= b <= 256 for b in sizes):
        raise UserError("--batch-sizes must be 1..256")
    return sizes


def _profile_vllm(args: argparse.Namespace) -> None:
    """The serving engine's own B × k step costs (and the drafters' per B), in the same format."""
    sizes = _sizes(args.batch_sizes)
    repeats = 1 if args.repeats is None else args.repeats
    if not sizes or not 1 <= repeats <= 20:
        raise UserError("profile --backend vllm needs --batch-sizes, and --repeats 1..20")
    if args.vllm_url:
        raise UserError("profile --backend vllm starts its own servers (a forced drafter is loaded into them)")
    base = RunRequest(**given(args, "model", "device", "dtype"))
    drafters = {}
    if args.draft:
        drafters["speculative"] = replace(base, strategy="speculative", draft=args.draft)
    if args.eagle3:
        drafters["eagle"] = replace(base, strategy="eagle", eagle3=args.eagle3)
    texts = None
    if args.served:
        if not 2 <= args.served_tokens <= 1024 or args.limit < 1:
            raise UserError("--served-tokens must be 2..1024 and --limit at least 1")
        categories = [c for c in (args.categories or "").split(",") if c] or None
        texts = [q.text for q in load_suite(args.suite, categories, args.limit)]
    result = engine_profile(
        base,
        sizes,
        repeats=repeats,
        drafters=drafters,
        progress=print,
        served_prompts=texts,
        new_tokens=args.served_tokens,
    )
    args.out.write_text(json.dumps(result.as_dict(), indent=1))
    fit = result.step_fit or {}
    print(f"{result.model} on vLLM {result.machine.get('vllm')}: one-sequence step {result.one_token_s * 1e3:.1f} ms")
    print(
        f"step ≈ {fit.get('fixed_s', 0) * 1e3:.1f} ms fixed + {fit.get('per_sequence_s', 0) * 1e3:.2f} ms per sequence"
        f" + {fit.get('per_token_s', 0) * 1e3:.2f} ms per sequence token"
    )
    for b, row in (result.batch_cost or {}).items():
        print(f"B = {b}: " + ", ".join(f"k={k}: {v:.2f}" for k, v in row.items()))
    for strategy, row in (result.draft_cost or {}).items():
        print(f"{strategy} drafted token / step: " + ", ".join(f"B={b}: {v:.3f}" for b, v in row.items()))
    print(f"exactly k tokens verified per step (share of steps, by k): {result.forced_share}")
    served = parse_served(result.served)
    if served is not None:
        for c in served.sizes:
            steps = ", ".join(f"k={k}: {rows[c].step_s * 1e3:.1f}" for k, rows in served.forced.items())
            plain = served.plain[c]
            print(
                f"as served, {c} clients: plain step {plain.step_s * 1e3:.1f} ms, speculative path {steps} ms; "
                f"a round of prefills {plain.prefill_s * 1e3:.0f} ms"
            )
    print(f"written to {args.out}")


def _answers(model: str, n: int, device: str, dtype: str) -> list[tuple[list[int], int]]:
    """Greedy answers (48 tokens) of `model` (as the user named it: a registry id or a directory,
    which the runner loads from the same process cache) to the first prompt of n Spec-Bench
    categories."""
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
