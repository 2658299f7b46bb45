"""What a serving engine's steps cost as the sweep serves them, and the speedup that follows.

A profile's lockstep grid (engine_profile: B equal requests started together, equal drafts, no
prefill after the first step) misses what served traffic adds: prompts of the sweep's lengths
whose prefills are mixed into other requests' decode steps, requests at different positions, the
speculative path's own cost when a step drafts nothing, and each drafter's prefill of every
prompt. So `profile --backend vllm` also serves, at every concurrency C, C closed-loop clients
with real prompts on each server (plain, the forced drafter at each k, every drafter at its
length), twice: once with one output token a request (a round of C prefills, as served) and once
with `new_tokens` (ignore_eos). Per server and C that gives a `Level`: a round of prefills and a
decode step, each as served.

The model is then one line per side: a client's request costs (decode steps) × (decode step) +
(its round's prefill); speedup = plain's request cost / the strategy's, the same tokens out.
Pure functions over these numbers, so they can be checked by hand."""

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from mtp_viz.theory import interpolated

DRAFTING = ("speculative", "eagle")  # strategies whose drafter runs a forward per drafted token
TERMS = (
    "decode step per concurrency and tokens scored, as served (real prompts, ragged positions)",
    "the speculative path's cost when nothing is drafted (forced k = 1 against plain serving)",
    "prefill mixed into decode steps, per server (the drafter's own prefill included)",
    "a drafted token's drafter cost per concurrency, from the drafter's server at its length",
)
NOT_MODELLED = (
    "acceptance varying with load (the sweep's measured tokens per step are used)",
    "a drafted token's cost past the measured grid (extended in proportion to the tokens)",
)


@dataclass(frozen=True)
class Level:
    """One server at one concurrency C, as served."""

    step_s: float  # a decode step of C requests, their prefills taken out
    prefill_s: float  # a round of C prompts' prefill (one each), as served
    prompt_tokens: float  # the mean prompt length it was measured with
    decode_steps: float  # decode steps a request took in the measurement


@dataclass(frozen=True)
class ServedCosts:
    plain: dict[int, Level]  # C → plain serving (no speculative config)
    forced: dict[int, dict[int, Level]]  # tokens scored per sequence per step k → C → the speculative path
    drafters: dict[str, dict[int, Level]]  # strategy → C → its drafter's server
    lengths: dict[str, int]  # strategy → the draft length its server ran with
    new_tokens: int  # output tokens a request was timed over

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.plain)


def parse_served(data: Mapping | None) -> ServedCosts | None:
    """ServedCosts from a profile's JSON (keys are strings there); None where it has none."""
    if not data:
        return None

    def levels(rows: Mapping) -> dict[int, Level]:
        return {int(c): Level(**{k: float(v) for k, v in row.items()}) for c, row in rows.items()}

    return ServedCosts(
        plain=levels(data["plain"]),
        forced={int(k): levels(rows) for k, rows in data["forced"].items()},
        drafters={str(s): levels(rows) for s, rows in (data.get("drafters") or {}).items()},
        lengths={str(s): int(n) for s, n in (data.get("lengths") or {}).items()},
        new_tokens=int(data["new_tokens"]),
    )


def at(levels: Mapping[int, Level], c: float, field: str) -> float:
    """A Level field at concurrency c, linear between the measured C (held past the ends)."""
    curve = {k: getattr(v, field) for k, v in levels.items()}
    return interpolated(curve, min(c, max(curve)))


def forced_step(costs: ServedCosts, c: float, scored: float) -> float:
    """A decode step on the speculative path scoring `scored` tokens a sequence (no drafter)."""
    return interpolated({k: at(rows, c, "step_s") for k, rows in costs.forced.items()}, scored)


def drafter_per_token(costs: ServedCosts, strategy: str, c: float) -> float | None:
    """What one drafted token adds to a step at C on the strategy's drafter server (beyond the
    forced step scoring as many tokens); None where that drafter was not measured."""
    rows = costs.drafters.get(strategy)
    if not rows:
        return None
    length = costs.lengths[strategy]
    return max(0.0, (at(rows, c, "step_s") - forced_step(costs, c, length + 1)) / length)


def step(costs: ServedCosts, strategy: str, c: float, scored: float) -> float | None:
    """A strategy's decode step at C scoring `scored` tokens a sequence, as served."""
    base = forced_step(costs, c, scored)
    if strategy not in DRAFTING:
        return base
    per_token = drafter_per_token(costs, strategy, c)
    return None if per_token is None else base + per_token * (scored - 1.0)


def prefill(costs: ServedCosts, strategy: str, c: float, prompt_tokens: float) -> float | None:
    """A round of C prompts' prefill on the strategy's server, scaled to `prompt_tokens`."""
    if strategy == "autoregressive":
        rows = costs.plain
    elif strategy in DRAFTING:
        rows = costs.drafters.get(strategy)
        if not rows:
            return None
    else:
        rows = costs.forced[min(costs.forced)]
    return at(rows, c, "prefill_s") * prompt_tokens / max(1.0, at(rows, c, "prompt_tokens"))


def request_cost(
    costs: ServedCosts, strategy: str, c: float, decode_steps: float, scored: float, prompt_tokens: float
) -> float | None:
    """One client's request on a server at C: its decode steps plus its round's prefill."""
    one = at(costs.plain, c, "step_s") if strategy == "autoregressive" else step(costs, strategy, c, scored)
    pre = prefill(costs, strategy, c, prompt_tokens)
    return None if one is None or pre is None else decode_steps * one + pre


def decode_rates(tokens: float, tokens_per_forward: float, scored_per_forward: float) -> tuple[float, float]:
    """(tokens a decode step gave a sequence, tokens it scored) from a request's tokens and the
    per-forward figures a sweep measured, which count the prefill's forward (one token, nothing
    drafted) among the forwards."""
    forwards = tokens / tokens_per_forward
    decode = max(forwards - 1.0, 1e-9)
    return max(1.0, (tokens - 1.0) / decode), 1.0 + (scored_per_forward - 1.0) * forwards / decode


@dataclass(frozen=True)
class ServedRequest:
    """What a sweep row's requests were: output tokens each, tokens a decode step gave a sequence
    and scored (decode_rates), and prompt tokens."""

    tokens: float
    per_step: float
    scored: float
    prompt: float


def served_request(row: Mapping) -> ServedRequest | None:
    """A sweep row's request (its mean over the row's requests); None where the row lacks a figure
    the served model needs (an older sweep without `prompt_tokens`, a row with no requests)."""
    names = ("new_tokens", "requests", "mean_accepted_tokens", "scored_per_forward", "prompt_tokens")
    values = [row.get(name) for name in names]
    if any(v is None or v != v for v in values) or float(row["requests"]) <= 0:  # v != v: NaN
        return None
    tokens = float(row["new_tokens"]) / float(row["requests"])
    per_step, scored = decode_rates(tokens, float(row["mean_accepted_tokens"]), float(row["scored_per_forward"]))
    return ServedRequest(tokens, per_step, scored, float(row["prompt_tokens"]))


def served_speedup(
    costs: ServedCosts, strategy: str, c: float, tokens: float, tokens_per_step: float, scored: float, prompt: float
) -> float | None:
    """Throughput over plain serving at C for requests of `tokens` output tokens whose decode steps
    give `tokens_per_step` a sequence scoring `scored` (the prefill's token aside)."""
    decode = max(0.0, tokens - 1.0)
    plain = request_cost(costs, "autoregressive", c, decode, 1.0, prompt)
    mine = request_cost(costs, strategy, c, decode / max(1.0, tokens_per_step), scored, prompt)
    return None if plain is None or mine is None or mine <= 0 else plain / mine
