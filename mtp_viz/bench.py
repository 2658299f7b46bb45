"""Prompt suites → traces → pandas tables: every strategy on the same prompts, in the same order,
with autoregressive decoding in the same invocation as the baseline of every speedup."""

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.llama_peers import LLAMA_CPP_PEERS, LlamaCppPeers, PeerFailed, unavailable
from mtp_viz.loading import DrafterRequest, load_drafting, load_model, model_name, resolve_device
from mtp_viz.machine import machine_info
from mtp_viz.peers import HF_ASSISTED, PEERS, PeerRun, run_peer
from mtp_viz.prompts import SUITE_FORMATS, BenchPrompt, read_suite, spec_bench
from mtp_viz.quality import final_number, first_divergence, reference_answer, target_nll
from mtp_viz.registry import load_registry
from mtp_viz.runner import RunRequest, run
from mtp_viz.serving.peers import VLLM_PEERS, VLLMPeers
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.variants import build_strategy_settings, parse_variant
from mtp_viz.trace import Trace, depth_counts

log = logging.getLogger(__name__)

SUITES = ("spec-bench",)
BASELINE = "autoregressive"
MATH_CATEGORIES = ("math", "math_reasoning")  # final numbers compared with autoregressive's


def load_suite(suite: str, categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """The first turn of each question of Spec-Bench (`spec-bench`) or of a suite file of one's own
    (mtp_viz.prompts.read_suite: Spec-Bench's JSONL, or one prompt a line); `limit` applies per category."""
    if suite in SUITES:
        questions, name = spec_bench(), "Spec-Bench"
    elif Path(suite).is_file():
        questions, name = read_suite(Path(suite)), Path(suite).name
    else:
        raise UserError(f"unknown suite {suite!r}: not {', '.join(SUITES)}, and no such file ({SUITE_FORMATS})")
    known = sorted({q["category"] for q in questions})
    unknown = sorted(set(categories or []) - set(known))
    if unknown:
        raise UserError(f"unknown categories {', '.join(unknown)}; {name} has: {', '.join(known)}")
    taken: dict[str, int] = {}
    prompts = []
    for q in questions:
        c = q["category"]
        if categories and c not in categories:
            continue
        if limit is not None and taken.get(c, 0) >= limit:
            continue
        taken[c] = taken.get(c, 0) + 1
        answer = reference_answer((q.get("reference") or [None])[0])
        prompts.append(BenchPrompt(str(q["question_id"]), c, q["turns"][0], answer))
    return prompts


def run_bench(
    prompts: list[BenchPrompt],
    strategies: list[str],
    base: RunRequest,
    settings_for: Callable[[str], dict] = lambda s: {},
    progress: Callable[[int, int], None] | None = None,
    peers: list[str] = (),
) -> tuple[dict[str, list[Trace]], dict[str, list[PeerRun]]]:
    """label → one trace per prompt, and peer (another engine) → one run per prompt.

    A label is a strategy name or a variant with settings ("conf_adapt:tau=0.8"), so one run can
    sweep a setting. On each prompt autoregressive runs first, then the strategies, then the
    peers, all on the same prompt ids; one warm-up run before any timing is discarded. llama.cpp
    peers are optional: where llama_cpp is not installed, or the model ships no GGUF, they are
    skipped with one logged line."""
    variants = {label: parse_variant(label) for label in dict.fromkeys(strategies)}
    order = [BASELINE] + [label for label in variants if label != BASELINE]
    known = PEERS + VLLM_PEERS + LLAMA_CPP_PEERS
    for peer in peers:
        if peer not in known:
            raise UserError(f"unknown peer {peer!r}; choose from {', '.join(known)}")
    served = VLLMPeers([p for p in peers if p in VLLM_PEERS], base, settings_for)  # requests checked now
    run(replace(base, prompt=prompts[0].text, strategy=BASELINE))  # warm-up, not recorded
    target = load_model(model_name(base.model, base.device), base.device, base.dtype)
    device_type = resolve_device(base.device).type
    for name, values in variants.values():  # bad settings or missing drafters fail before any timing
        settings = build_strategy_settings(name, {**settings_for(name), **values}, device_type)
        drafters = DrafterRequest(name, base.draft, base.heads, base.eagle3, base.device, base.dtype, base.weights)
        load_drafting(target, STRATEGIES[name].drafters(settings), drafters)
    if set(peers) & set(LLAMA_CPP_PEERS) and (why := unavailable(target.name)):
        log.warning(why)
        peers = [p for p in peers if p not in LLAMA_CPP_PEERS]
    draft = _peer_draft(base, target) if HF_ASSISTED in peers else None
    lookup = build_strategy_settings("prompt_lookup", settings_for("prompt_lookup"), device_type)
    local = LlamaCppPeers([p for p in peers if p in LLAMA_CPP_PEERS], target, machine_info()["threads"], lookup)
    k = build_strategy_settings("speculative", settings_for("speculative"), device_type).num_draft_tokens
    traces: dict[str, list[Trace]] = {label: [] for label in order}
    peer_runs: dict[str, list[PeerRun]] = {peer: [] for peer in peers}
    total, done = len(prompts) * (len(order) + len(peers)), 0
    failed: set[str] = set()  # llama.cpp peers whose process died or hung
    with served, local:  # vLLM peers' servers started before anything is timed; both always closed
        for p in prompts:
            for label in order:
                name, values = variants.get(label, (BASELINE, {}))
                request = replace(
                    base, prompt=p.text, strategy=name, strategy_settings={**settings_for(name), **values}
                )
                traces[label].append(run(request))
                done += 1
                if progress:
                    progress(done, total)
            prompt_ids = traces[BASELINE][-1].prompt_token_ids
            for peer in [p for p in peers if p not in failed]:
                if peer in VLLM_PEERS:
                    peer_runs[peer].append(served.run(peer, prompt_ids))
                elif peer in LLAMA_CPP_PEERS:
                    try:
                        peer_runs[peer].append(local.run(peer, prompt_ids, base.generation.max_new_tokens))
                    except PeerFailed as e:  # its process died or hung: one line; its runs so far are kept
                        log.warning("%s; %s left out from here on", e, peer)
                        failed.add(peer)
                else:
                    peer_runs[peer].append(run_peer(peer, target, prompt_ids, base.generation.max_new_tokens, draft, k))
                done += 1
                if progress:
                    progress(done, total)
    return traces, peer_runs


def _peer_draft(base: RunRequest, target):
    name = base.draft or next(iter(load_registry().models.get(target.name).drafts), None)
    if name is None:
        raise UserError("hf_assisted needs a draft model: pass --draft")
    return load_model(name, base.device, base.dtype)


def results_table(
    prompts: list[BenchPrompt],
    traces: dict[str, list[Trace]],
    peer_runs: dict[str, list[PeerRun]] | None = None,
    scorer=None,
) -> pd.DataFrame:
    """One row per (strategy, prompt) with the trace's metrics and its agreement with autoregressive;
    peers (transformers generate) have no trace, so only their speed and agreement. With a scorer
    (the original model), each output's negative log-likelihood per token under it."""

    def nll(prompt_ids: list[int], output_ids: list[int]) -> float:
        return float("nan") if scorer is None else target_nll(scorer, prompt_ids, output_ids)

    rows = []
    for peer, runs in (peer_runs or {}).items():
        done = len(runs)  # a peer whose process died has runs for the prompts before it died
        for p, r, ref in zip(prompts[:done], runs, traces[BASELINE][:done], strict=True):
            rows.append(
                {
                    "strategy": peer,
                    "prompt_id": p.id,
                    "category": p.category,
                    "new_tokens": len(r.output_token_ids),
                    "wall_time_s": r.wall_time_s,
                    "target_forwards": float("nan"),
                    "draft_forwards": float("nan"),
                    "scored_tokens": float("nan"),
                    "drafted_tokens": float("nan"),
                    "accepted_tokens": float("nan"),
                    "identical": first_divergence(ref.output_token_ids, r.output_token_ids) is None,
                    "agreement": _agreement(ref.output_token_ids, r.output_token_ids),
                    "answer_match": _answer_match(p, ref.output_text, r.output_text),
                    "math_accuracy": _accuracy(p, r.output_text),
                    "target_nll": nll(ref.prompt_token_ids, r.output_token_ids),
                    "depth_judged": [],
                    "depth_accepted": [],
                    "lossless": True,
                }
            )
    for strategy, runs in traces.items():
        for p, t, ref in zip(prompts, runs, traces[BASELINE], strict=True):
            s = t.summary
            div = first_divergence(ref.output_token_ids, t.output_token_ids)
            judged, accepted = depth_counts(t.steps)
            rows.append(
                {
                    "strategy": strategy,
                    "prompt_id": p.id,
                    "category": p.category,
                    "new_tokens": s["new_tokens"],
                    "wall_time_s": s["wall_time_s"],
                    "target_forwards": s["target_forwards"],
                    "draft_forwards": s["draft_forwards"],
                    # tokens each forward scored: what it fed, but the prompt's first P − 1 tokens
                    "scored_tokens": sum(step.input_tokens for step in t.steps) - len(t.prompt_token_ids) + 1,
                    "drafted_tokens": s["drafted_tokens"],
                    "accepted_tokens": s["accepted_tokens"],
                    "identical": div is None,
                    "agreement": _agreement(ref.output_token_ids, t.output_token_ids),
                    "answer_match": _answer_match(p, ref.output_text, t.output_text),
                    "math_accuracy": _accuracy(p, t.output_text),
                    "target_nll": nll(t.prompt_token_ids, t.output_token_ids),
                    "depth_judged": judged,
                    "depth_accepted": accepted,
                    "lossless": STRATEGIES[t.strategy].is_lossless(t.settings),
                }
            )
    return pd.DataFrame(rows)


def _answer_match(prompt: BenchPrompt, reference: str, text: str) -> float:
    """Math prompts: 1.0 if the final number equals autoregressive's, else 0.0; NaN elsewhere."""
    if prompt.category not in MATH_CATEGORIES:
        return float("nan")
    return float(final_number(text) == final_number(reference))


def _accuracy(prompt: BenchPrompt, text: str) -> float:
    """Prompts with a reference answer: 1.0 if the output's final number is it, else 0.0; NaN elsewhere."""
    if prompt.answer is None:
        return float("nan")
    return float(final_number(text) == prompt.answer)


def _agreement(ref: list[int], out: list[int]) -> float:
    """Share of the reference's tokens reproduced before the first divergence."""
    div = first_divergence(ref, out)
    return 1.0 if div is None else div / max(1, len(ref))


def summary_table(results: pd.DataFrame) -> pd.DataFrame:
    """Per category and overall: tokens/s (total tokens / total time), speedup over autoregressive,
    mean accepted tokens, tokens scored and draft forwards per target forward (what a forward
    costs under load, mtp_viz.theory.concurrency_speedup), acceptance rate, share of outputs
    identical to autoregressive, agreement, math answers (same as autoregressive's; right against
    the reference) and the original model's negative log-likelihood per token of the outputs
    (token-weighted)."""
    nll = results["target_nll"] if "target_nll" in results else pd.Series(float("nan"), index=results.index)
    scored = nll.notna()
    results = results.assign(
        target_nll_tokens=nll.where(scored) * results["new_tokens"], nll_tokens=results["new_tokens"].where(scored, 0)
    )
    if "math_accuracy" not in results:
        results = results.assign(math_accuracy=float("nan"))
    frames = [results, results.assign(category="overall")]
    g = pd.concat(frames).groupby(["category", "strategy"], sort=False)
    out = pd.DataFrame(
        {
            "prompts": g["prompt_id"].count(),
            "tokens_per_s": g["new_tokens"].sum() / g["wall_time_s"].sum(),
            "mean_accepted_tokens": g["new_tokens"].sum() / g["target_forwards"].sum(min_count=1),
            "acceptance_rate": g["accepted_tokens"].sum(min_count=1)
            / g["drafted_tokens"].sum(min_count=1).where(lambda x: x > 0),
            "scored_per_forward": g["scored_tokens"].sum(min_count=1) / g["target_forwards"].sum(min_count=1),
            "draft_forwards_per_forward": g["draft_forwards"].sum(min_count=1) / g["target_forwards"].sum(min_count=1),
            "identical_share": g["identical"].mean(),
            "agreement": g["agreement"].mean(),
            "math_answer_match": g["answer_match"].mean(),
            "math_accuracy": g["math_accuracy"].mean(),
            "target_nll": g["target_nll_tokens"].sum(min_count=1) / g["nll_tokens"].sum().where(lambda x: x > 0),
        }
    ).reset_index()
    out["per_position_acceptance"] = [
        _per_position(results[(results["strategy"] == s) & ((results["category"] == c) | (c == "overall"))])
        for c, s in zip(out["category"], out["strategy"], strict=True)
    ]
    base = out[out["strategy"] == BASELINE].set_index("category")["tokens_per_s"]
    out["speedup"] = out["tokens_per_s"] / out["category"].map(base)
    return out


def _per_position(rows: pd.DataFrame) -> list[float]:
    """Acceptance at each draft depth over all steps of these runs (steps that drafted that deep)."""
    depth = max((len(j) for j in rows["depth_judged"]), default=0)
    judged = [sum(j[i] for j in rows["depth_judged"] if i < len(j)) for i in range(depth)]
    kept = [sum(a[i] for a in rows["depth_accepted"] if i < len(a)) for i in range(depth)]
    return [round(k / n, 4) if n else 0.0 for k, n in zip(kept, judged, strict=True)]


def save(
    out_dir: Path,
    prompts: list[BenchPrompt],
    traces: dict[str, list[Trace]],
    peer_runs: dict[str, list[PeerRun]] | None = None,
    scorer=None,
) -> pd.DataFrame:
    """Writes results.csv, summary.csv, summary.json (the summary rows, the model and the machine
    they were measured on) and traces/<label>/<prompt id>.json."""
    results = results_table(prompts, traces, peer_runs, scorer)
    summary = summary_table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    results.to_csv(out_dir / "results.csv", index=False)
    summary.to_csv(out_dir / "summary.csv", index=False)
    first = next((runs[0] for runs in traces.values() if runs), None)
    machine = first.machine if first is not None else machine_info()
    peers = {p: runs[0].machine for p, runs in (peer_runs or {}).items() if runs and runs[0].machine}
    record = {
        "model": traces[BASELINE][0].model if traces.get(BASELINE) else None,
        "machine": {**machine, "peers": peers} if peers else machine,
        "rows": json.loads(summary.to_json(orient="records")),
    }
    (out_dir / "summary.json").write_text(json.dumps(record, indent=1))
    for label, runs in traces.items():
        folder = out_dir / "traces" / label.replace(":", "_").replace("=", "-").replace(",", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for p, t in zip(prompts, runs, strict=True):
            t.save(folder / f"{p.id}.json")
    return summary
