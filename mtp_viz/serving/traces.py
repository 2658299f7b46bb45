"""A vLLM completion as a Trace: the same format our engine writes, with what vLLM does not
report left null (a rejected draft's id, probabilities, per-step timings), never zero-filled.

vLLM reports, per request, the drafted and accepted counts of each verify step that drafted
(`--per-request-spec-decode-metrics detailed`). Its first step is the prefill, which drafts
nothing; a step whose proposer found nothing (an n-gram with no match) is a plain forward and is
not in the per-step lists. For `ngram` drafting those steps are placed by replaying vLLM's
matching rule (longest suffix n-gram in [min, max], its earliest occurrence: the same rule as our
prompt lookup) over the output, which also gives every drafted id; the replay is checked against
vLLM's own counts, step by step. For `draft_model` and `eagle3` every step drafts, so steps follow
in order.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from mtp_viz.errors import UserError
from mtp_viz.serving.client import Completion
from mtp_viz.serving.methods import DRAFT_MODEL, EAGLE3, NGRAM
from mtp_viz.strategies.prompt_lookup import find_draft
from mtp_viz.trace import (
    ACCEPTED,
    AUTOREGRESSIVE,
    BONUS,
    RESAMPLED,
    STOP_EOS,
    STOP_MAX_NEW_TOKENS,
    DraftToken,
    EmittedToken,
    Step,
    Trace,
    chain_verdicts,
)

ENGINE = "vllm"
SOURCES = {NGRAM: "ngram", DRAFT_MODEL: "draft_model", EAGLE3: "eagle3"}
SCHEDULED = "num_speculative_tokens_per_batch_size"  # a draft length per batch size (mtp_viz.schedule)


class StepMismatch(UserError):
    """vLLM's reported steps do not fit the output (a different matching rule, or a changed format)."""


@dataclass(frozen=True)
class Served:
    """How the completion was produced: what the trace records beside the tokens."""

    strategy: str
    model: str
    draft_model: str | None
    method: str | None  # vLLM's speculative method, None for plain decoding
    speculative_config: dict | None
    settings: dict[str, Any]  # the trace's flat settings (generation, strategy, raw, eos ...)
    eos_token_ids: frozenset[int]
    machine: dict[str, Any]  # machine_info() of this machine plus the engine: vllm version, server args


def steps_from_completion(c: Completion, served: Served) -> tuple[list[Step], dict[str, Any]]:
    """The steps of a completion, and what was checked while placing them."""
    out = c.token_ids
    spec = c.spec or {}
    drafted_counts = list(spec.get("per_step_drafted") or [])
    accepted_counts = list(spec.get("per_step_accepted") or [])
    if served.method is not None and spec and not drafted_counts and spec.get("num_spec_steps"):
        raise StepMismatch("vLLM reported no per-step counts: start it with --per-request-spec-decode-metrics detailed")
    prompt = c.prompt_token_ids
    steps: list[Step] = []
    if not out:
        return steps, {"placed_by": "none"}
    steps.append(_plain(0, out[0], len(prompt), len(prompt)))  # the prefill: vLLM drafts nothing in it
    pos, reported = 1, 0
    source = SOURCES.get(served.method or "", "draft")
    config = served.speculative_config or {}
    replay = served.method == NGRAM
    if replay and config.get(SCHEDULED):
        try:
            placed = _scheduled_ngram(out, prompt, config, served.settings, drafted_counts, accepted_counts)
        except StepMismatch as e:  # the counts stay exact; where each step ran is not known
            placed, replay, placed_by = None, False, f"in order, the n-gram replay not fitting ({e})"
        if placed is not None:
            for at, draft_ids, n_acc in placed:
                kv = len(prompt) + at - 1
                if draft_ids:
                    steps.append(_verified(len(steps), out, at, list(draft_ids), n_acc, source, kv))
                else:
                    steps.append(_plain(len(steps), out[at], 1, kv + 1))
            return steps, {"placed_by": "ngram replay under a schedule, checked"}
    else:
        placed_by = "ngram replay, checked" if replay else "in order"
    while pos < len(out):
        kv = len(prompt) + pos - 1
        if replay:
            seq = np.asarray(prompt + out[:pos])
            k = min(config["num_speculative_tokens"], served.settings.get("max_model_len", 1 << 30) - len(seq))
            ids, _, _ = (
                find_draft(seq, config["prompt_lookup_max"], config["prompt_lookup_min"], k) if k > 0 else ([], 0, -1)
            )
            if not ids:
                steps.append(_plain(len(steps), out[pos], 1, kv + 1))
                pos += 1
                continue
            if reported >= len(drafted_counts) or drafted_counts[reported] != len(ids):
                got = drafted_counts[reported] if reported < len(drafted_counts) else "none"
                raise StepMismatch(
                    f"the n-gram replay drafts {len(ids)} tokens at output position {pos}, vLLM reported {got}"
                )
            draft_ids: list[int | None] = list(ids)
        else:
            if reported >= len(drafted_counts):
                steps.append(_plain(len(steps), out[pos], 1, kv + 1))
                pos += 1
                continue
            draft_ids = [None] * drafted_counts[reported]
        n_acc = accepted_counts[reported]
        reported += 1
        steps.append(_verified(len(steps), out, pos, draft_ids, n_acc, source, kv))
        pos += len(steps[-1].emitted)
    if reported != len(drafted_counts):
        raise StepMismatch(f"vLLM reported {len(drafted_counts)} verify steps, {reported} fit the output")
    return steps, {"placed_by": placed_by}


def _ngram_ids(seq: list[int], config: dict, settings: dict) -> list[int]:
    """What vLLM's n-gram proposer drafts after `seq` at the configured (longest) draft length."""
    k = min(config["num_speculative_tokens"], settings.get("max_model_len", 1 << 30) - len(seq))
    if k <= 0:
        return []
    ids, _, _ = find_draft(np.asarray(seq), config["prompt_lookup_max"], config["prompt_lookup_min"], k)
    return list(ids)


def _scheduled_ngram(
    out: list[int], prompt: list[int], config: dict, settings: dict, drafted: list[int], accepted: list[int]
) -> list[tuple[int, tuple[int, ...], int]]:
    """Under a schedule a step's draft length depends on the batch at that moment, which vLLM does
    not report: (output position, drafted ids, accepted) per step after the prefill, placed where
    every reported step fits. A reported step at position p drafted the first d ids of the replay's
    match there, its accepted ones equal the output and the next differs (it was refused); a
    position with a match may also have been a plain step (a length of 0 in the table). The first
    placement that uses every reported step, drafting wherever it can; StepMismatch when none does.
    Without a 0 in the table the placement is vLLM's; with one, a plain step and a drafting one can
    both fit the counts, and a step may be placed before the position where vLLM ran it (its counts
    and tokens stay exact)."""
    zero_allowed = any(int(k) == 0 for *_, k in config[SCHEDULED])
    failed: set[tuple[int, int]] = set()
    path: list[tuple[int, tuple[int, ...], int]] = []

    def options(pos: int, r: int):
        if r < len(drafted) and drafted[r] == 0:  # a step the engine counted with nothing drafted: a plain one
            yield pos + 1, r + 1, (pos, (), 0)
        ids = _ngram_ids(prompt + out[:pos], config, settings)
        if ids and r < len(drafted):
            d, a = drafted[r], accepted[r]
            kept = ids[:d]
            # accepted drafts equal the output, as far as it goes (the budget may cut a step's)
            fits = 0 < d <= len(ids) and a <= d and out[pos : pos + a] == kept[: min(a, len(out) - pos)]
            if fits and (a == d or pos + a >= len(out) or kept[a] != out[pos + a]):  # the refused one differs
                yield pos + a + 1, r + 1, (pos, tuple(kept), a)
        if not ids or zero_allowed:
            yield pos + 1, r, (pos, (), 0)

    stack = [(1, 0, options(1, 0))]
    while stack:
        pos, r, choices = stack[-1]
        if pos >= len(out) and r == len(drafted):
            return path
        nxt = next(choices, None) if pos < len(out) else None
        if nxt is None:
            failed.add((pos, r))
            stack.pop()
            if path:
                path.pop()
            continue
        npos, nr, step = nxt
        if (npos, nr) in failed:
            continue
        path.append(step)
        stack.append((npos, nr, options(npos, nr)))
    raise StepMismatch(f"no placement of vLLM's {len(drafted)} reported steps fits the output under the schedule")


def _plain(index: int, token: int, fed: int, kv_len: int) -> Step:
    return Step(
        index=index,
        emitted=[EmittedToken(token, AUTOREGRESSIVE)],
        draft_s=None,
        verify_s=None,
        step_s=None,
        target_forwards=1,
        input_tokens=fed,
        kv_len=kv_len,
    )


def _verified(index: int, out: list[int], pos: int, draft_ids: list[int | None], accepted: int, source: str, kv: int):
    """One verify step: `accepted` drafts kept, then the target's own token (resampled after a
    rejection, bonus after a full acceptance), cut where the output ends (EOS or the budget)."""
    k = len(draft_ids)
    if accepted > k:
        raise StepMismatch(f"vLLM reported {accepted} accepted of {k} drafted")
    for i in range(min(accepted, len(out) - pos)):
        if draft_ids[i] is None:
            draft_ids[i] = out[pos + i]  # an accepted draft is the output token there
        elif draft_ids[i] != out[pos + i]:
            raise StepMismatch(f"accepted draft {i} at output position {pos} differs from the output token")
    emitted_ids = out[pos : pos + accepted + 1]
    kept = min(accepted, len(emitted_ids))
    emitted = [EmittedToken(t, ACCEPTED) for t in emitted_ids[:kept]]
    if len(emitted_ids) > kept:
        emitted.append(EmittedToken(emitted_ids[kept], BONUS if accepted == k else RESAMPLED))
    verdicts = chain_verdicts(k, accepted)
    return Step(
        index=index,
        emitted=emitted,
        drafted=[DraftToken(t, source) for t in draft_ids],
        verdicts=verdicts,
        target_p=[None] * k,
        draws=[None] * k,
        draft_s=None,
        verify_s=None,
        step_s=None,
        target_forwards=1,
        input_tokens=1 + k,
        kv_len=kv + len(emitted),
    )


def trace_from_completion(
    c: Completion, served: Served, prompt_text: str = "", output_text: str | None = None
) -> Trace:
    steps, placement = steps_from_completion(c, served)
    eos = bool(c.token_ids) and c.token_ids[-1] in served.eos_token_ids
    trace = Trace(
        strategy=served.strategy,
        model=served.model,
        draft_model=served.draft_model,
        settings=served.settings,
        prompt_token_ids=list(c.prompt_token_ids),
        output_token_ids=list(c.token_ids),
        steps=steps,
        wall_time_s=c.wall_s,
        stop_reason=STOP_EOS if eos else STOP_MAX_NEW_TOKENS,
        output_text=c.text if output_text is None else output_text,
        prompt_text=prompt_text,
        device="cuda:0" if served.machine.get("gpu") else "cpu",
        dtype=served.machine.get("dtype", "float32"),
        machine={
            **served.machine,
            "engine": ENGINE,
            "steps_placed_by": placement["placed_by"],
            "ttft_s": c.ttft_s,
            "server_metrics": {k: v for k, v in (c.metrics or {}).items() if k != "speculative_decoding"},
            "vllm_mean_acceptance_length": (c.spec or {}).get("mean_acceptance_length"),
        },
    )
    trace.check()
    return trace
