"""The trace: one plain-data record of a decoding run that every strategy emits and every view reads.

A run is a list of `Step`s, one per target verification (or autoregressive forward). Summaries are
derived from the steps, never stored twice: `Trace.summary` recomputes them, and a loaded trace is
re-summarised from its steps. Format documented in docs/trace-format.md.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtp_viz.errors import InvalidTraceError
from mtp_viz.visibility import node_depths

SCHEMA_VERSION = 4  # 2: token trees (parent −1 = the root); 3: the machine and engine it ran on;
# 4: what an engine does not report may be null (a drafted token's id, a step's timings)
READABLE_VERSIONS = (1, 2, 3, 4)  # older traces are valid version-4 traces without trees / machine

# Where an emitted token came from.
AUTOREGRESSIVE = "autoregressive"  # the target's own next token, no draft involved
ACCEPTED = "accepted"  # a drafted token the target verified
RESAMPLED = "resampled"  # the target's token at the first rejected position
BONUS = "bonus"  # the target's extra token after a fully accepted draft
UNVERIFIED = "unverified"  # emitted without target verification (lossy strategies)
ORIGINS = (AUTOREGRESSIVE, ACCEPTED, RESAMPLED, BONUS, UNVERIFIED)

# What verification said of a drafted token.
VERDICT_ACCEPTED = "accepted"
VERDICT_REJECTED = "rejected"
VERDICT_SKIPPED = "skipped"  # not judged: after a rejection, after EOS, or past the token budget
VERDICTS = (VERDICT_ACCEPTED, VERDICT_REJECTED, VERDICT_SKIPPED)

STOP_EOS = "eos"
STOP_MAX_NEW_TOKENS = "max_new_tokens"
STOP_CANCELLED = "cancelled"
STOP_REASONS = (STOP_EOS, STOP_MAX_NEW_TOKENS, STOP_CANCELLED)


@dataclass
class DraftToken:
    token_id: int | None  # None: the engine reported that a token was drafted, not which (vLLM)
    source: str  # "draft_model", "ngram", later "head_k", "jacobi", "pool", ...
    q: float | None = None  # drafter's probability of this token (None where there is none)
    text: str = ""
    parent: int | None = None  # index in `drafted` of the token it follows; None: the previous one; −1: the root


@dataclass
class EmittedToken:
    token_id: int
    origin: str
    p: float | None = None  # target probability of this token where the target judged it
    text: str = ""
    confidence: float | None = None  # for unverified tokens: the predictor's confidence


@dataclass
class Step:
    index: int
    emitted: list[EmittedToken]
    drafted: list[DraftToken] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)  # one per drafted token
    target_p: list[float | None] = field(default_factory=list)  # p_target of each drafted token
    draws: list[float | None] = field(default_factory=list)  # uniform draw deciding each verdict
    draft_s: float | None = 0.0  # None (here and below): not reported by the engine that ran it
    verify_s: float | None = 0.0
    step_s: float | None = 0.0  # whole step: drafting, verifying and bookkeeping
    target_forwards: int = 0
    draft_forwards: int = 0
    input_tokens: int = 0  # tokens fed to the target in this step (prompt on the first step)
    kv_len: int = 0  # target KV-cache length after the step
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific detail, plain data

    @property
    def accepted(self) -> int:
        return self.verdicts.count(VERDICT_ACCEPTED)

    @property
    def depths(self) -> list[int]:
        """Depth of each drafted token: 1 for the first guess after the last emitted token. In a
        chain, drafted[i] has depth i+1; in a tree, a node's depth is its parent's plus one."""
        return node_depths([i - 1 if d.parent is None else d.parent for i, d in enumerate(self.drafted)])


def chain_verdicts(drafted: int, accepted: int) -> list[str]:
    """The verdicts of a chain of `drafted` tokens whose first `accepted` were kept: the next one
    rejected, the rest never judged."""
    verdicts = [VERDICT_ACCEPTED] * accepted + [VERDICT_SKIPPED] * (drafted - accepted)
    if accepted < drafted:
        verdicts[accepted] = VERDICT_REJECTED
    return verdicts


def depth_counts(steps: list[Step]) -> tuple[list[int], list[int]]:
    """Per draft depth d (index d−1): steps that drafted a token at depth d, and steps in which a
    token at depth d was accepted. In a chain, depth = position in the draft."""
    judged: list[int] = []
    kept: list[int] = []
    for s in steps:
        depths = s.depths
        for d in set(depths):
            while len(judged) < d:
                judged.append(0)
                kept.append(0)
            judged[d - 1] += 1
        for d in {d for d, v in zip(depths, s.verdicts, strict=True) if v == VERDICT_ACCEPTED}:
            kept[d - 1] += 1
    return judged, kept


def _total(values) -> float | None:
    """The sum, or None when any part was not measured (a serving engine's steps)."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def engine_label(trace: "Trace") -> str:
    """Which engine ran a trace, for the views' notes on what it did not report."""
    return "vLLM" if trace.machine.get("engine") == "vllm" else "mtp-viz"


def timed(steps: list[Step]) -> bool:
    """Whether the steps carry their own timings (our engine's do; a serving engine's do not)."""
    return all(s.step_s is not None for s in steps)


def summarize(steps: list[Step], wall_time_s: float) -> dict[str, Any]:
    """Metrics as defined in DESIGN.md, derived from the steps alone (plus the measured wall time)."""
    new_tokens = sum(len(s.emitted) for s in steps)
    target_forwards = sum(s.target_forwards for s in steps)
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(s.accepted for s in steps)
    judged, kept = depth_counts(steps)
    per_position = [k / n for k, n in zip(kept, judged, strict=True)]
    return {
        "new_tokens": new_tokens,
        "wall_time_s": wall_time_s,
        "tokens_per_s": new_tokens / wall_time_s if wall_time_s > 0 else 0.0,
        "target_forwards": target_forwards,
        "draft_forwards": sum(s.draft_forwards for s in steps),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_tokens": new_tokens / target_forwards if target_forwards else 0.0,
        "per_position_acceptance": per_position,
        "draft_time_s": _total(s.draft_s for s in steps),
        "verify_time_s": _total(s.verify_s for s in steps),
    }


@dataclass(kw_only=True)
class Trace:
    # Fields in the order the JSON shows them: what ran and what came out, its summary, where it
    # ran, then the prompt text and the steps (docs/trace-format.md).
    schema_version: int = SCHEMA_VERSION
    strategy: str
    model: str
    draft_model: str | None
    settings: dict[str, Any]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str = ""
    wall_time_s: float  # the JSON has the summary here, which holds it
    stop_reason: str
    device: str = "cpu"
    dtype: str = "float32"
    machine: dict[str, Any] = field(default_factory=dict)  # mtp_viz.machine.machine_info + engine; {} if unknown
    prompt_text: str = ""
    steps: list[Step]

    @property
    def summary(self) -> dict[str, Any]:
        return summarize(self.steps, self.wall_time_s)

    def check(self) -> None:
        """Raise InvalidTraceError unless the trace is internally consistent."""
        emitted = [t.token_id for s in self.steps for t in s.emitted]
        if emitted != self.output_token_ids:
            raise InvalidTraceError("emitted tokens of the steps do not add up to output_token_ids")
        for s in self.steps:
            if not (len(s.verdicts) == len(s.target_p) == len(s.drafted)):
                raise InvalidTraceError(f"step {s.index}: drafted, verdicts and target_p differ in length")
            if any(d.parent is not None and not -1 <= d.parent < i for i, d in enumerate(s.drafted)):
                raise InvalidTraceError(f"step {s.index}: a drafted token's parent must be -1 or an earlier index")
            if any(v not in VERDICTS for v in s.verdicts):
                raise InvalidTraceError(f"step {s.index}: unknown verdict in {s.verdicts}")
            if any(t.origin not in ORIGINS for t in s.emitted):
                raise InvalidTraceError(f"step {s.index}: unknown token origin")
        if self.stop_reason not in STOP_REASONS:
            raise InvalidTraceError(f"unknown stop_reason {self.stop_reason!r}")
        if not (math.isfinite(self.wall_time_s) and self.wall_time_s >= 0):
            raise InvalidTraceError("wall_time_s must be a finite non-negative number")

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for key, value in asdict(self).items():
            if key == "wall_time_s":
                out["summary"] = self.summary  # wall_time_s lives in the summary
            else:
                out[key] = value
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False, allow_nan=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1), encoding="utf-8")

    @classmethod
    def from_dict(cls, d: Any) -> "Trace":
        if not isinstance(d, dict):
            raise InvalidTraceError("a trace is a JSON object")
        version = d.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            readable = " and ".join(map(str, READABLE_VERSIONS))
            raise InvalidTraceError(f"unsupported schema_version {version!r} (this build reads {readable})")
        try:
            steps = [_step_from_dict(s) for s in d["steps"]]
            trace = cls(
                strategy=str(d["strategy"]),
                model=str(d["model"]),
                draft_model=None if d["draft_model"] is None else str(d["draft_model"]),
                settings=dict(d["settings"]),
                prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
                output_token_ids=[int(t) for t in d["output_token_ids"]],
                steps=steps,
                wall_time_s=float(d["summary"]["wall_time_s"]),
                stop_reason=str(d["stop_reason"]),
                output_text=str(d.get("output_text", "")),
                prompt_text=str(d.get("prompt_text", "")),
                device=str(d.get("device", "cpu")),
                dtype=str(d.get("dtype", "float32")),
                machine=dict(d.get("machine") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidTraceError(f"malformed trace: {type(e).__name__}: {e}") from None
        trace.check()
        return trace

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidTraceError(f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def _maybe_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _step_from_dict(d: dict[str, Any]) -> Step:
    return Step(
        index=int(d["index"]),
        emitted=[EmittedToken(**t) for t in d["emitted"]],
        drafted=[DraftToken(**t) for t in d["drafted"]],
        verdicts=[str(v) for v in d["verdicts"]],
        target_p=[None if p is None else float(p) for p in d["target_p"]],
        draws=[None if u is None else float(u) for u in d["draws"]],
        draft_s=_maybe_float(d["draft_s"]),
        verify_s=_maybe_float(d["verify_s"]),
        step_s=_maybe_float(d["step_s"]),
        target_forwards=int(d["target_forwards"]),
        draft_forwards=int(d["draft_forwards"]),
        input_tokens=int(d["input_tokens"]),
        kv_len=int(d["kv_len"]),
        extra=dict(d.get("extra", {})),
    )
