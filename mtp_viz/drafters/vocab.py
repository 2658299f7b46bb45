"""A reduced, frequency-ranked vocabulary for drafters (FR-Spec, Zhao et al. 2025).

On a CPU the target's 49,152 × 576 output projection is a large share of a small model's step.
A drafter that only scores the most frequent tokens pays a fraction of that. It still emits
full-vocabulary logits (−inf outside the subset), so strategies and the speculative accept rule
see an ordinary distribution that puts no mass on tokens it cannot draft: lossless as before.
"""

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from mtp_viz.kernels import Planned, fast_linear


class ReducedHead(Planned):
    """The target's LM-head rows for `ids`, frozen; full-vocabulary logits out. Its product runs
    on the model's linear plan (a Planned module: mtp_viz.kernels.use_fast_linears sets `plan`)."""

    def __init__(self, full_weight: torch.Tensor, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("ids", ids.long(), persistent=False)
        self.weight = nn.Parameter(full_weight.detach()[ids.long()].clone(), requires_grad=False)  # (V', H)
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[ids.long()] = torch.arange(len(ids))
        self.register_buffer("index", index, persistent=False)  # full id → reduced id, −1 if absent
        self.product: nn.Module | None = None  # the rows in a weight format (mtp_viz.weights), when one is applied

    def reduced(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) → (..., V') logits over the subset."""
        if self.product is not None:
            return self.product(hidden)
        return fast_linear(hidden, self.weight, plan=self.plan)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) → (..., V) logits, −inf for tokens outside the subset."""
        small = self.reduced(hidden)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, small)


def frequent_tokens(token_lists: Iterable[torch.Tensor], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties by id), `always` included (e.g. EOS), sorted ascending."""
    counts: Counter = Counter()
    for tokens in token_lists:
        counts.update(tokens.tolist())
    chosen = list(dict.fromkeys(always))
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)
