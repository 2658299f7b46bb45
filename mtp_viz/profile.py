"""Measure, on the current device, what one target forward over k tokens costs relative to one
token (the verify-cost curve), and the draft/target cost ratio c."""

import statistics
from dataclasses import asdict, dataclass

import torch

from mtp_viz.cache import CachedModel
from mtp_viz.clock import Clock
from mtp_viz.models import LoadedModel

MAX_K = 32
CONTEXT_TOKENS = 256  # the KV-cache length the forwards run against


@dataclass(frozen=True)
class Profile:
    model: str
    draft_model: str | None
    device: str
    dtype: str
    one_token_s: float  # median time of a one-token target forward
    verify_cost: dict[int, float]  # k → time of a k-token forward / one_token_s
    c: float | None  # draft one-token forward / target one-token forward

    def as_dict(self) -> dict:
        return asdict(self)


class _Timer:
    """Times forwards of k new tokens after a fixed cached context, rolling the cache back each time."""

    def __init__(self, model, context: int):
        self.clock = Clock(model.device)
        self.cached = CachedModel(model)
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
) -> Profile:
    """Medians over `repeats` rounds; each round times every k and the draft, interleaved, so drift
    on a noisy machine hits all of them alike."""
    ks = list(range(1, max_k + 1))
    target_timer = _Timer(target.model, context)
    draft_timer = _Timer(draft.model, context) if draft is not None else None
    times: dict[int, list[float]] = {k: [] for k in ks}
    draft_times: list[float] = []
    for _ in range(repeats):
        for k in ks:
            times[k].append(target_timer.time(k))
        if draft_timer is not None:
            draft_times.append(draft_timer.time(1))
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
    )
