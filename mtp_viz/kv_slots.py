"""The lean forward's key/value cache and which of its slots each row attends to.

`StaticKV` holds every layer's keys and values in one preallocated tensor: a slot per sequence
position, rollback is a length kept by the caller, and keeping a tree's accepted path moves only
those entries. `visibility` turns a strategy's "may attend" matrix into the mask one batched
attention call takes; `RowKeys` lists each row's slots for attention one row at a time.
"""

from dataclasses import dataclass

import torch

from mtp_viz.visibility import causal_after


def visibility(allowed: torch.Tensor | None, rows: int, end: int, width: int, device) -> torch.Tensor | None:
    """The attention mask (1, 1, rows, width) over the first `width` slots: `allowed` (rows, end),
    or every slot before `end` when None; nothing from `end` on. None when that is every slot."""
    if allowed is None and width == end:
        return None
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, :end] = True if allowed is None else allowed
    return mask.to(device)[None, None]


@dataclass(frozen=True)
class RowKeys:
    """Attention one row at a time: per row, the cache slots it sees, as a count (the first n
    slots) or as slot indices (a tree node: the prefix and its ancestors). Each row then runs the
    very call a one-token forward at its position makes, over the same keys in the same order, so
    its result does not depend on how many rows the forward holds: a batched SDPA's does, by ~1e-7,
    which bfloat16 products turn into logit differences up to ~0.3 (measured).

    Rows whose result decides nothing (lookahead's Jacobi guesses) may attend in one batched call
    instead: `batched` holds their row indices and mask, and their entry in `rows` is None."""

    rows: tuple[int | torch.Tensor | None, ...]
    batched: tuple[torch.Tensor, torch.Tensor] | None = None  # row indices, mask (1, 1, n, start+s)

    @staticmethod
    def of(allowed: torch.Tensor | None, start: int, s: int, device, loose: tuple[int, ...] = ()) -> "RowKeys":
        """From the (s, start+s) visibility (None: causal) of rows at slots start..start+s−1; the
        rows `loose` names attend batched."""
        if allowed is None:
            if not loose:  # causal: row i sees the first start + i + 1 slots
                return RowKeys(tuple(range(start + 1, start + s + 1)))
            allowed = causal_after(start, s)
        rows: list[int | torch.Tensor | None] = []
        for i, seen in enumerate(allowed):
            if i in loose:
                rows.append(None)
                continue
            slots = seen.nonzero()[:, 0]
            n = len(slots)
            rows.append(n if int(slots[-1]) == n - 1 else slots.to(device))
        batched = None
        if loose:
            index = torch.tensor(sorted(loose), dtype=torch.long)
            batched = (index.to(device), allowed[index].to(device)[None, None])
        return RowKeys(tuple(rows), batched)

    def keys(self, kv: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values (kv_heads, n, d) row `row` sees in kv (2, kv_heads, width, d)."""
        seen = self.rows[row]
        assert seen is not None, "a batched row has no keys of its own"
        if isinstance(seen, int):
            return kv[0, :, :seen], kv[1, :, :seen]
        return kv[0].index_select(1, seen), kv[1].index_select(1, seen)


class StaticKV:
    """Key/values of every layer in one preallocated tensor (layers, 2, kv_heads, capacity, head_dim).

    Positions are slots: entry i holds the key/value of the token at sequence position i. What
    holds valid entries is tracked by the caller (CachedModel's `length`); rollback only moves it.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int):
        self.device = device
        self.data = self._alloc(torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device))

    @staticmethod
    def _alloc(data: torch.Tensor) -> torch.Tensor:
        if data.device.type == "cuda":  # CUDA graphs replay against a fixed address
            torch._dynamo.mark_static_address(data)
        return data

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def ensure(self, needed: int) -> None:
        """Grow (doubling, copying the old entries) until `needed` slots fit."""
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        grown = self.data.new_zeros(*self.data.shape[:3], capacity, self.data.shape[4])
        grown[:, :, :, : self.capacity] = self.data
        self.data = self._alloc(grown)

    def move(self, start: int, rows: list[int]) -> None:
        """Slots start..start+len(rows)−1 take the entries at start + r for r in rows (every layer)."""
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.device)
        self.data[:, :, :, start : start + len(rows)] = self.data.index_select(3, index)
