"""A speculation schedule: per number of concurrent sequences B, the draft length that maximises
predicted throughput (0: do not speculate), from a serving engine's step costs and a strategy's
measured acceptance; written as the table vLLM takes (`num_speculative_tokens_per_batch_size`: a
list of (batch from, batch to, draft tokens), inclusive, the first starting at 1).

With costs as served (mtp_viz.served_costs) a draft length of 0 still pays the speculative path,
so the recommendation is a deployable configuration (`deployable`): the table while speculation
pays by a margin, and plain serving (no speculative config) from the load where it stops.

Pure functions over plain numbers, so a schedule can be checked on hand-made costs."""

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mtp_viz.errors import UserError
from mtp_viz.served_costs import ServedCosts, served_speedup
from mtp_viz.theory import interpolated

MAX_DRAFT = 8  # the longest draft a schedule considers
MARGIN = 0.03  # speculate only where predicted at least this much above plain serving (the model's error)
Table = tuple[tuple[int, int, int], ...]  # (batch from, batch to, draft tokens), sorted, inclusive


@dataclass(frozen=True)
class Acceptance:
    """What a strategy's drafts are worth, measured at one draft length and extended to others."""

    positions: tuple[float, ...]  # depth d (index d−1) → share of drafted depth-d tokens accepted
    drafting: float  # share of steps whose draft counts (tokens per step = 1 + drafting · Σ positions)
    fill: float  # drafted tokens per step per unit of draft length (a lookup that finds no match: < 1)
    draft_forwards: bool  # each drafted token costs a drafter forward (draft model, EAGLE), not a lookup

    def rate(self, depth: int) -> float:
        """Acceptance at a depth, measured or past the measured ones extended geometrically."""
        p = self.positions
        if depth <= len(p):
            return p[depth - 1]
        ratio = p[-1] / p[-2] if len(p) > 1 and p[-2] > 0 else p[-1]
        return p[-1] * min(1.0, ratio) ** (depth - len(p))

    def tokens(self, k: int) -> float:
        """Tokens per step with drafts of length k (k = 0: one)."""
        return 1.0 + self.drafting * sum(self.rate(d) for d in range(1, k + 1)) if self.positions else 1.0

    def scored(self, k: int) -> float:
        """Tokens a step scores per sequence with drafts of length k."""
        return 1.0 + self.fill * k


def measured_acceptance(
    tokens_per_step: float, scored_per_step: float, positions: Sequence[float], k: int, draft_forwards: bool
) -> Acceptance:
    """An Acceptance that reproduces what a run with drafts of length k measured: tokens per step
    (the bonus included), tokens scored per sequence per step, per-depth acceptance."""
    if k < 1 or tokens_per_step < 1 or scored_per_step < 1:
        raise UserError("acceptance needs a draft length >= 1 and tokens per step >= 1")
    rates = tuple(float(r) for r in positions[:k] if not math.isnan(float(r)))
    expected = sum(rates)
    drafting = (tokens_per_step - 1.0) / expected if expected > 0 else 0.0
    return Acceptance(rates, min(1.0, drafting), (scored_per_step - 1.0) / k, draft_forwards)


@dataclass(frozen=True)
class StepCosts:
    """A serving engine's step costs, each relative to its one-token step at the same B."""

    batch_cost: Mapping[int, Mapping[int, float]]  # B → tokens per sequence → T(B, k) / T(B, 1)
    one_token_s: Mapping[int, float] | None = None  # B → T(B, 1) in seconds (to weigh B between measured)
    draft_cost: Mapping[int, float] | float | None = None  # B → one drafted token's drafter cost / T(B, 1)
    served: ServedCosts | None = None  # the engine's costs as served: the prediction reads these where given
    strategy: str = ""  # whose drafter (served costs)
    request: tuple[float, float] = (64.0, 256.0)  # (output tokens, prompt tokens) of a request (served costs)

    def relative(self, batch: int, scored: float) -> float:
        """T(batch, scored) / T(batch, 1), linear in B between the measured batch sizes."""
        low, high, w = _between(sorted(self.batch_cost), batch)
        if low == high:
            return interpolated(self.batch_cost[low], scored)
        one = self.one_token_s or {}
        t_low, t_high = one.get(low, 1.0), one.get(high, 1.0)
        absolute = (1 - w) * t_low * interpolated(self.batch_cost[low], scored) + w * t_high * interpolated(
            self.batch_cost[high], scored
        )
        return absolute / ((1 - w) * t_low + w * t_high)

    def draft(self, batch: int) -> float:
        """One drafted token's drafter cost relative to T(batch, 1)."""
        cost = self.draft_cost
        if cost is None:
            raise UserError("this profile has no draft cost: measure it with --draft")
        if not isinstance(cost, Mapping):
            return float(cost)
        low, high, w = _between(sorted(cost), batch)
        return (1 - w) * cost[low] + w * cost[high]


def _between(sizes: list[int], batch: int) -> tuple[int, int, float]:
    """The measured sizes around `batch` and its weight towards the upper one (held at the ends)."""
    if batch <= sizes[0]:
        return sizes[0], sizes[0], 0.0
    for low, high in zip(sizes, sizes[1:], strict=False):
        if batch <= high:
            return low, high, (batch - low) / (high - low)
    return sizes[-1], sizes[-1], 0.0


def predicted_speedup(costs: StepCosts, acceptance: Acceptance, batch: int, k: int) -> float:
    """Throughput with drafts of length k over plain decoding, B sequences sharing each step (with
    served costs, k = 0 is the speculative server drafting nothing, which costs what it costs)."""
    if costs.served is not None:
        tokens, prompt = costs.request
        value = served_speedup(
            costs.served, costs.strategy, batch, tokens, acceptance.tokens(k), acceptance.scored(k), prompt
        )
        if value is None:
            raise UserError(f"this profile has no served costs of {costs.strategy}'s drafter: measure it with --draft")
        return value
    if k == 0:
        return 1.0
    scored = acceptance.scored(k)
    drafts = (scored - 1.0) * costs.draft(batch) if acceptance.draft_forwards else 0.0
    return acceptance.tokens(k) / (costs.relative(batch, scored) + drafts)


def best_length(costs: StepCosts, acceptance: Acceptance, batch: int, max_k: int = MAX_DRAFT) -> int:
    """The draft length with the highest predicted throughput at this B (ties: the shorter)."""
    return max(range(max_k + 1), key=lambda k: (predicted_speedup(costs, acceptance, batch, k), -k))


def recommend(costs: StepCosts, acceptance: Acceptance, max_batch: int | None = None, max_k: int = MAX_DRAFT) -> Table:
    """The best draft length at every B from 1 to max_batch (default: the largest measured),
    runs of equal lengths merged into one range."""
    last = max_batch or max(costs.batch_cost)
    return compress([best_length(costs, acceptance, b, max_k) for b in range(1, last + 1)])


@dataclass(frozen=True)
class Recommendation:
    """A deployable configuration: the speculative server's table, and the load from which plain
    serving (no speculative config) is predicted at least as fast (None: speculation pays at every
    B up to the last; 1: do not speculate)."""

    table: Table
    plain_from: int | None
    predicted: dict[int, float]  # B → the recommended configuration's predicted speedup over plain serving

    def speculates_at(self, batch: int) -> bool:
        return self.plain_from is None or batch < self.plain_from


def deployable(
    costs: StepCosts, acceptance: Acceptance, max_batch: int, max_k: int = MAX_DRAFT, margin: float = MARGIN
) -> Recommendation:
    """The best draft length at every B (0 included), and plain serving from the B that leaves
    speculation the most predicted gain over `margin` below it (Σ log(gain / (1 + margin)) over
    B < plain_from, the smallest such B on a tie): where speculation stops paying, and never a
    dip below plain left speculating between loads where it pays (the table keeps 0 from there:
    a load above the expected one on the speculative server)."""
    table = recommend(costs, acceptance, max_batch, max_k)
    best = {b: length_at(table, b) for b in range(1, max_batch + 1)}
    gain = {b: predicted_speedup(costs, acceptance, b, k) for b, k in best.items()}
    kept = [0.0]  # kept[p - 1]: what speculating below B = p keeps
    for b in range(1, max_batch + 1):
        kept.append(kept[-1] + math.log(max(gain[b], 1e-9) / (1.0 + margin)))
    top = max(kept)
    crossover = 1 + min(i for i, v in enumerate(kept) if v >= top - 1e-12)
    plain_from = None if crossover > max_batch else crossover
    lengths = [best[b] if plain_from is None or b < plain_from else 0 for b in range(1, max_batch + 1)]
    predicted = {b: gain[b] if plain_from is None or b < plain_from else 1.0 for b in best}
    return Recommendation(compress(lengths), plain_from, predicted)


def compress(lengths: Sequence[int]) -> Table:
    """Draft lengths for B = 1, 2, ... → ranges of equal length."""
    table: list[tuple[int, int, int]] = []
    for b, k in enumerate(lengths, start=1):
        if table and table[-1][2] == k:
            table[-1] = (table[-1][0], b, k)
        else:
            table.append((b, b, k))
    return tuple(table)


def length_at(table: Table, batch: int) -> int:
    """The draft length a table gives at B (past its last range, the last range's, as vLLM does)."""
    for start, end, k in table:
        if start <= batch <= end:
            return k
    return table[-1][2] if batch > table[-1][1] else 0


def crossover(table: Table) -> int | None:
    """The smallest B from which the table never speculates again; None if it always does."""
    if table[-1][2] != 0:
        return None
    start = table[-1][0]
    for s, _, k in reversed(table):
        if k != 0:
            break
        start = s
    return start


def checked(entries) -> Table:
    """A table in vLLM's form (a list of [from, to, tokens]) checked as vLLM 0.32 checks it: every
    entry three integers, ranges positive, from <= to, sorted without overlap, the first from 1."""
    if not isinstance(entries, list | tuple) or not entries:
        raise UserError("a schedule is a non-empty list of (batch from, batch to, draft tokens)")
    table = []
    for entry in entries:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise UserError(f"each schedule entry is (batch from, batch to, draft tokens), got {entry!r}")
        start, end, k = (int(v) for v in entry)
        if start < 1 or end < start or k < 0:
            raise UserError(f"schedule entry {entry!r}: need 1 <= from <= to and draft tokens >= 0")
        table.append((start, end, k))
    table.sort()
    if table[0][0] != 1:
        raise UserError("a schedule's first range starts at batch size 1")
    for (_, end, _), (start, _, _) in zip(table, table[1:], strict=False):
        if start <= end:
            raise UserError("schedule ranges must not overlap")
    return tuple(table)


def to_vllm(table: Table) -> list[list[int]]:
    """The table as speculative_config's `num_speculative_tokens_per_batch_size`."""
    return [list(entry) for entry in table]


def format_table(table: Table) -> str:
    """ "1-2:3,3-32:0": B 1..2 draft 3 tokens, 3..32 none (what `bench --schedule` takes)."""
    return ",".join(f"{start}-{end}:{k}" for start, end, k in table)


def parse_table(text: str) -> Table:
    """A table as `format_table` writes it, or vLLM's JSON form ("[[1,2,3],[3,32,0]]")."""
    text = text.strip()
    try:
        if text.startswith("["):
            return checked(json.loads(text))
        entries = []
        for part in text.split(","):
            span, _, k = part.partition(":")
            start, _, end = span.partition("-")
            entries.append((int(start), int(end or start), int(k)))
    except ValueError:
        raise UserError(f"not a schedule: {text!r} (expected e.g. 1-2:3,3-32:0)") from None
    return checked(entries)
