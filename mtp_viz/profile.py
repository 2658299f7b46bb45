"""Measure, on the current device, what one target forward over k tokens costs relative to one
token (the verify-cost curve), the draft/target cost ratio c, how often an early exit after each
layer agrees with the model's own next-token choice (why self-speculation accepts what it does),
and what forwards of B sequences × k tokens cost (B concurrent users, each verifying k tokens:
whether speculation survives load, mtp_viz.theory.concurrency_speedup)."""

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from mtp_viz.cache import CachedModel, engine_for
from mtp_viz.clock import Clock
from mtp_viz.errors import UserError
from mtp_viz.loading import LoadedModel
from mtp_viz.machine import machine_info, machine_label
from mtp_viz.served_costs import ServedCosts, parse_served

MAX_K = 32
CONTEXT_TOKENS = 256  # the KV-cache length the forwards run against
BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # concurrent sequences
BATCH_KS = (1, 2, 3, 4, 6, 8)  # tokens per sequence per forward
BATCH_CONTEXT = 128  # each sequence's cached length in the batched timings
BATCH_REPEATS = 3


@dataclass(frozen=True)
class Profile:
    model: str
    draft_model: str | None
    device: str
    dtype: str
    one_token_s: float  # median time of a one-token target forward
    verify_cost: dict[int, float]  # k → time of a k-token forward / one_token_s
    c: float | None  # draft one-token forward / target one-token forward
    exit_agreement: dict[int, float] | None = None  # layer L → P(exit after L layers' top-1 = model's top-1)
    machine: dict | None = None  # mtp_viz.machine.machine_info + the linear path: where it was measured
    # B → k → time of a forward of B sequences × k tokens / time of B × 1 (transformers' batched forward)
    batch_cost: dict[int, dict[int, float]] | None = None
    batch_one_token_s: dict[int, float] | None = None  # B → time of the B × 1 forward
    engine: str = "mtp-viz"  # whose forwards: our engine, or a serving engine's steps ("vllm")
    step_fit: dict[str, float] | None = None  # a serving engine's step: fixed_s + per_sequence_s·B + per_token_s·B·k
    draft_cost: dict[str, dict[int, float]] | None = None  # strategy → B → a drafted token's drafter cost / T(B, 1)
    drafters: dict[str, str | None] | None = None  # strategy → the drafter whose cost was measured
    forced_share: dict[str, float | None] | None = None  # k → share of steps that scored exactly k tokens, as forced
    served: dict | None = None  # a serving engine's costs as served (mtp_viz.served_costs.ServedCosts.as_dict)
    how: dict[str, str] | None = None  # figure → how it was obtained

    def as_dict(self) -> dict:
        return asdict(self)


class _Timer:
    """Times forwards of k new tokens after a fixed cached context, rolling the cache back each
    time; the k rows run as a strategy's verify runs them (one at a time after the context)."""

    def __init__(self, model, context: int):
        self.clock = Clock(model.device)
        self.cached = CachedModel(model, prompt_length=context)
        self.vocab = model.config.vocab_size
        self.prefix = [i % self.vocab for i in range(context)]
        self.cached.forward(self.prefix)

    def time(self, k: int) -> float:
        seq = self.prefix + [(7 * i) % self.vocab for i in range(k)]
        start = self.clock.now()
        self.cached.forward(seq, logits_to_keep=k)
        elapsed = self.clock.now() - start
        self.cached.rollback(len(self.prefix))
        return elapsed


@torch.inference_mode()
def profile(
    target: LoadedModel,
    draft: LoadedModel | None = None,
    max_k: int = MAX_K,
    repeats: int = 5,
    context: int = CONTEXT_TOKENS,
    progress: Callable[[int, int], bool | None] | None = None,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
) -> Profile:
    """Medians over `repeats` rounds; each round times every k and the draft, interleaved, so drift
    on a noisy machine hits all of them alike; then the batched forwards (B in `batch_sizes`; none:
    skipped). `progress(done, total)` is called after each round; when it returns True, measuring
    stops and Cancelled is raised."""
    ks = list(range(1, max_k + 1))
    target_timer = _Timer(target.model, context)
    draft_timer = _Timer(draft.model, context) if draft is not None else None
    times: dict[int, list[float]] = {k: [] for k in ks}
    draft_times: list[float] = []
    total = repeats + (BATCH_REPEATS if batch_sizes else 0)
    for _ in range(repeats):
        for k in ks:
            times[k].append(target_timer.time(k))
        if draft_timer is not None:
            draft_times.append(draft_timer.time(1))
        if progress is not None and progress(len(draft_times or times[1]), total):
            raise Cancelled("profile stopped")
    batch_cost = batch_one = None
    if batch_sizes:
        batch_cost, batch_one = batch_profile(
            target.model, batch_sizes, progress=progress and (lambda done, _: progress(repeats + done, total))
        )
    median = {k: statistics.median(v) for k, v in times.items()}
    c = statistics.median(draft_times) / median[1] if draft_times else None
    return Profile(
        target.name,
        draft.name if draft else None,
        str(target.device),
        target.dtype,
        median[1],
        {k: t / median[1] for k, t in median.items()},
        c,
        machine={
            **machine_info(target.device),
            "forward": engine_for(target.model),
            "linear": target.linear,
            "weights": target.weights_detail,
        },
        batch_cost=batch_cost,
        batch_one_token_s=batch_one,
    )


class _BatchTimer:
    """Times forwards of B sequences × k new tokens after a cached context of each (transformers'
    batched forward and cache: the lean engine decodes one sequence), cropping the cache each time."""

    def __init__(self, model, batch: int, context: int):
        self.model, self.batch, self.context = model, batch, context
        self.clock = Clock(model.device)
        vocab = model.config.vocab_size
        ids = torch.tensor([[(i * 31 + b * 7) % vocab for i in range(context)] for b in range(batch)])
        self.cache = DynamicCache(config=model.config)
        model(input_ids=ids.to(model.device), past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def time(self, k: int) -> float:
        vocab = self.model.config.vocab_size
        ids = torch.tensor(
            [[(7 * i + b) % vocab for i in range(k)] for b in range(self.batch)], device=self.model.device
        )
        positions = torch.arange(self.context, self.context + k, device=self.model.device).expand(self.batch, k)
        start = self.clock.now()
        self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True, logits_to_keep=k)
        elapsed = self.clock.now() - start
        self.cache.crop(-k)
        return elapsed


@torch.inference_mode()
def batch_profile(
    model,
    sizes: tuple[int, ...] = BATCH_SIZES,
    ks: tuple[int, ...] = BATCH_KS,
    repeats: int = BATCH_REPEATS,
    context: int = BATCH_CONTEXT,
    progress: Callable[[int, int], bool | None] | None = None,
) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """(B → k → T(B, k) / T(B, 1), B → T(B, 1) seconds), medians over `repeats` interleaved rounds."""
    timers = {b: _BatchTimer(model, b, context) for b in sizes}
    times: dict[tuple[int, int], list[float]] = {(b, k): [] for b in sizes for k in ks}
    for round_ in range(repeats):
        for b in sizes:
            for k in ks:
                times[b, k].append(timers[b].time(k))
        if progress is not None and progress(round_ + 1, repeats):
            raise Cancelled("profile stopped")
    median = {key: statistics.median(v) for key, v in times.items()}
    one = {b: median[b, min(ks)] for b in sizes}
    return {b: {k: median[b, k] / one[b] for k in ks} for b in sizes}, one


class Cancelled(Exception):
    """A measurement stopped by its caller."""


@torch.inference_mode()
def exit_agreement(model, sequences: list[tuple[list[int], int]]) -> dict[int, float]:
    """For each layer L: the share of answer positions where the early exit after L layers (the
    final norm and head applied to layer L's hidden state, as `self_speculative` drafts) picks
    the same next token as the full model. sequences: (token ids, prompt length) pairs."""
    agree: dict[int, int] = {}
    total = 0
    norm, head = model.model.norm, model.get_output_embeddings()
    for ids, prompt_len in sequences:
        out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
        answer = slice(prompt_len - 1, len(ids) - 1)  # positions that predicted an answer token
        final = out.logits[0, answer].argmax(-1)
        layers = out.hidden_states[1:]  # after layer 1 .. N (the last already normalised)
        for layer, hidden in enumerate(layers, start=1):
            h = hidden[0, answer]
            guess = head(h if layer == len(layers) else norm(h)).argmax(-1)
            agree[layer] = agree.get(layer, 0) + int((guess == final).sum())
        total += len(final)
    return {layer: n / max(1, total) for layer, n in agree.items()}


MAX_PROFILE_BYTES = 8 * 2**20  # a profile file above this is refused (an upload)
NOT_A_PROFILE = "not a profile: expected the JSON that `python -m mtp_viz profile` writes"


DraftCost = float | dict[str, dict[int, float]] | None  # c, or per strategy and B as a serving engine measured it
Prefill = tuple[float, dict[int, float]]  # (seconds per prompt token in a step, B → seconds of a one-token step)


@dataclass(frozen=True)
class ProfileView:
    """A profile file as the views read it."""

    curve: dict[int, float]  # verify cost: k → time of k tokens / one token ({}: not measured)
    exits: dict[int, float] | None  # early-exit agreement by layer, where measured
    label: str  # the machine it was measured on
    batch_cost: dict[int, dict[int, float]] | None  # B → k → relative cost, where measured
    c: float | None  # draft / target cost, where a draft was measured
    engine: str = "mtp-viz"
    one_token_s: dict[int, float] | None = None  # B → seconds of a B × 1 step
    draft_cost: dict[str, dict[int, float]] | None = None  # strategy → B → drafted token's cost / T(B, 1)

    step_fit: dict[str, float] | None = None  # a serving engine's step: fixed + per sequence + per token
    served: ServedCosts | None = None  # a serving engine's costs as served, where measured

    def prefill(self) -> Prefill | None:
        """What a prompt token costs the engine's step (its per-token cost) and B → a one-token
        step's seconds, where the engine's steps were fitted; None for our engine's forwards."""
        fit = self.step_fit or {}
        return (fit["per_token_s"], self.one_token_s) if fit.get("per_token_s") and self.one_token_s else None

    def draft_costs(self) -> DraftCost:
        """What a drafted token costs: per strategy and B where the engine measured it, else c."""
        return self.draft_cost or self.c


def profile_label(machine: dict | None) -> str:
    """ "AMD EPYC, 2 threads" (", q4" where measured in a weight format): how a curve names its machine."""
    if not isinstance(machine, dict) or not machine:
        return "machine not recorded"
    if machine.get("engine") == "vllm":
        return f"{machine_label(machine)}, vLLM {machine.get('vllm') or '?'} steps"
    weights = str(machine.get("weights") or "").split(" ")[0]
    return machine_label(machine) + (f", {weights}" if weights else "")


def read_profile(path: str | Path | None) -> ProfileView | None:
    """A profile (`python -m mtp_viz profile`, or the app's measurement of this machine); None: no file."""
    if not path:
        return None
    try:
        if Path(path).stat().st_size > MAX_PROFILE_BYTES:
            raise UserError("that profile file is too large")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        cost = data.get("batch_cost") or {}
        view = ProfileView(
            curve={int(k): float(v) for k, v in (data.get("verify_cost") or {}).items()},
            exits={int(k): float(v) for k, v in (data.get("exit_agreement") or {}).items()} or None,
            label=profile_label(data.get("machine")),
            batch_cost={int(b): {int(k): float(v) for k, v in row.items()} for b, row in cost.items()} or None,
            c=data.get("c"),
            engine=str(data.get("engine") or "mtp-viz"),
            one_token_s={int(b): float(t) for b, t in (data.get("batch_one_token_s") or {}).items()} or None,
            draft_cost={
                str(s): {int(b): float(v) for b, v in row.items()} for s, row in (data.get("draft_cost") or {}).items()
            }
            or None,
            step_fit={str(k): float(v) for k, v in (data.get("step_fit") or {}).items()} or None,
            served=parse_served(data.get("served")),
        )
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(NOT_A_PROFILE) from None
    if not view.curve and view.batch_cost is None:  # neither measurement: some other JSON
        raise UserError(NOT_A_PROFILE)
    return view


def read_batch_profile(path: Path | None) -> tuple[dict[int, dict[int, float]] | None, DraftCost, str]:
    """(B → k → relative cost, a drafted token's cost (ProfileView.draft_costs), machine label) of a
    profile; None where it has no B × k timings."""
    view = read_profile(path)
    return (view.batch_cost, view.draft_costs(), view.label) if view else (None, None, "no profile")
