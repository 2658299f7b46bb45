"""What an acceptance rule decides in a step, and the record the trace keeps of it.

The rule (base.verify_chain, base.verify_tree) returns a `Decision`: plain data the loop acts on
(commit `tokens`, keep `cached_path`'s key/values, let a schedule read `accepted`). `record` turns
it into the step's `Outcome`, what the trace shows: a verdict, p_target and draw per drafted
token, and each emitted token with its origin. Nothing re-derives the decision from that record.
"""

from dataclasses import dataclass, field

from mtp_viz.trace import VERDICT_ACCEPTED, VERDICT_REJECTED, VERDICT_SKIPPED, EmittedToken


@dataclass(frozen=True)
class Decision:
    """One verified draft (a chain is the tree whose node i follows node i − 1), cut where
    autoregressive decoding would stop: after the first EOS, or at the token budget."""

    drafted: int  # tokens drafted (a chain's length, a tree's nodes)
    path: tuple[int, ...]  # the drafted tokens kept, as indices into the draft, root side first
    rejected: tuple[int, ...]  # drafted tokens the rule refused, as the record shows them
    tokens: tuple[int, ...]  # to commit: the kept drafted tokens, then the target's own unless cut
    origins: tuple[str, ...]  # per committed token: accepted, resampled, bonus or autoregressive
    p_target: tuple[float | None, ...]  # per drafted token: the target's probability of it (None: not recorded)
    p_tokens: tuple[float | None, ...]  # per committed token: the target's probability of it
    draws: tuple[float | None, ...]  # per drafted token: the uniform draw that judged it (None: none)

    @property
    def accepted(self) -> int:
        """The accepted length: drafted tokens kept."""
        return len(self.path)

    @property
    def cached_path(self) -> tuple[int, ...]:
        """The kept drafted tokens whose key/values stay cached: every committed token's but the
        last, which the next forward feeds."""
        return self.path[: len(self.tokens) - 1]


@dataclass
class Outcome:
    """A step's result as the trace records it: what was emitted, and per drafted token its
    verdict, p_target and the uniform draw that decided it."""

    emitted: list[EmittedToken]
    verdicts: list[str] = field(default_factory=list)
    target_p: list[float | None] = field(default_factory=list)
    draws: list[float | None] = field(default_factory=list)


def record(decision: Decision) -> Outcome:
    """The trace's record of a decision: kept tokens accepted, refused ones rejected, the rest skipped."""
    verdicts = [VERDICT_SKIPPED] * decision.drafted
    for i in decision.rejected:
        verdicts[i] = VERDICT_REJECTED
    for i in decision.path:
        verdicts[i] = VERDICT_ACCEPTED
    emitted = [
        EmittedToken(t, origin, p)
        for t, origin, p in zip(decision.tokens, decision.origins, decision.p_tokens, strict=True)
    ]
    return Outcome(emitted, verdicts, list(decision.p_target), list(decision.draws))
