"""A model with its own KV cache that can be extended and rolled back.

Every strategy keeps one `CachedModel` per model it runs. The cache holds the key/values of the
first `length` tokens of the sequence the strategy is building; `forward(seq)` feeds whatever of
`seq` the cache has not seen yet (the whole prompt on the first call), and `rollback(n)` forgets
everything after position n, e.g. the rejected part of a draft block.

Token trees (MTP heads, lookahead) go through `forward_hidden`: the unseen part of the sequence,
then extra tokens that see the sequence and only the extra tokens a visibility matrix allows (for
a tree: their own ancestors, at position = the root's position + depth). `keep` then retains the
key/values of the accepted tokens alone, so the cache again holds one plain sequence.

An EAGLE-3 target goes through `forward_features`: the same forward, also returning the residual
stream after chosen layers (its `taps`) at every row fed, the features its drafter reads.

Two backends do the forward: the lean one (mtp_viz.lean: a preallocated cache, rollback is a
length) for Llama-family models, and transformers' own decoder with its DynamicCache for any
other architecture (or for every model with MTP_VIZ_ENGINE=transformers, to compare).
"""

import os

import torch
from transformers import DynamicCache, PreTrainedModel

from mtp_viz.lean import lean_model
from mtp_viz.visibility import causal, causal_after


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """(q, kv) bool "may attend" → the (1, 1, q, kv) additive mask attention layers take."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


ENGINE_ENV = "MTP_VIZ_ENGINE"
LEAN, TRANSFORMERS = "lean", "transformers"
ENGINES = (LEAN, TRANSFORMERS)


def engine_for(model: PreTrainedModel) -> str:
    """`lean` where the lean forward supports the model (unless MTP_VIZ_ENGINE=transformers)."""
    wanted = os.environ.get(ENGINE_ENV, LEAN).strip().lower()
    return LEAN if wanted != TRANSFORMERS and lean_model(model) is not None else TRANSFORMERS


class LeanBackend:
    """The lean forward (mtp_viz.lean) over a preallocated cache: rollback is free."""

    def __init__(self, model: PreTrainedModel, exact_from: int | None = None):
        self.lean = lean_model(model)
        self.kv = self.lean.new_cache()
        self.exact_from = exact_from

    def run(
        self,
        ids: list[int],
        positions: list[int],
        past: int,
        allowed: torch.Tensor | None,
        loose: tuple[int, ...] = (),
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.lean.embed(torch.tensor(ids, dtype=torch.long, device=self.lean.device))
        kv, exact = self.kv, self.exact_from
        out, tapped = self.lean.run_tapped(hidden, positions, kv, past, allowed, taps, exact_from=exact, loose=loose)
        return self.lean.norm(out), torch.cat(tapped, -1) if taps else None

    def keep(self, start: int, rows: list[int]) -> None:
        self.kv.move(start, rows)

    def rollback(self, length: int, cached: int) -> None:
        pass  # slots past `length` are overwritten before they are read again


class TransformersBackend:
    """transformers' own decoder forward with its DynamicCache: any architecture."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = DynamicCache(config=model.config)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        past: int,
        allowed: torch.Tensor | None,
        loose: tuple[int, ...] = (),
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.model.device
        out = self.model.get_decoder()(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            attention_mask=None if allowed is None else additive_mask(allowed, self.model.dtype, device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=bool(taps),
        )
        features = torch.cat([out.hidden_states[k][0] for k in taps], -1) if taps else None
        return out.last_hidden_state[0], features  # (S, H) after the final norm; (S, len(taps)·H)

    def keep(self, start: int, rows: list[int]) -> None:
        index = torch.tensor([start + r for r in rows], dtype=torch.long, device=self.model.device)
        n = len(rows)
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys[..., start : start + n, :] = layer.keys.index_select(-2, index)
                layer.values[..., start : start + n, :] = layer.values.index_select(-2, index)

    def rollback(self, length: int, cached: int) -> None:
        self.cache.crop(length - cached)


class CachedModel:
    """`prompt_length` (a strategy's target, on the lean engine): every forward row after the
    prompt's first prompt_length − 1 tokens computes what a one-token forward computes
    (kv_slots.RowKeys), so a strategy verifying k tokens in one forward scores them as
    autoregressive decoding would (bit for bit where the weight format's products are
    row-invariant: docs/BENCHMARKS.md, "Lossless on the same weights")."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, prompt_length: int | None = None):
        self.model = model
        self.device = model.device
        self.vocab_size = vocab_size or model.config.vocab_size
        self.engine = engine_for(model)
        exact_from = None if prompt_length is None else max(prompt_length - 1, 0)
        self.backend = LeanBackend(model, exact_from) if self.engine == LEAN else TransformersBackend(model)
        self.head = model.get_output_embeddings()
        self.length = 0  # tokens whose key/values are cached
        self.forwards = 0

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)[:, : self.vocab_size].float()

    @torch.inference_mode()
    def forward(self, seq: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Feed `seq[self.length:]`; return logits of its last `logits_to_keep` positions: (n, V)."""
        new = seq[self.length :]
        assert new, "forward needs at least one token the cache has not seen"
        past, n = self.length, len(new)
        allowed = causal_after(past, n) if n > 1 else None
        hidden, _ = self.backend.run(new, list(range(past, past + n)), past, allowed)
        self.length = len(seq)
        self.forwards += 1
        return self._logits(hidden[-min(logits_to_keep, n) :])  # (logits_to_keep, V)

    @torch.inference_mode()
    def forward_hidden(
        self,
        seq: list[int],
        extra: list[int] = (),
        offsets: list[int] = (),
        visibility: torch.Tensor | None = None,
        loose: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `seq[self.length:]` causally, then `extra` tokens placed at seq's last position +
        `offsets`, each seeing the whole sequence and the extra tokens `visibility` (n, n) allows
        (a token tree: mtp_viz.visibility's node_depths and tree_visibility). Returns logits (1 + n, V)
        and final hidden states (1 + n, H): a row for seq's last token, then one per extra token.
        With no extra tokens this is a plain forward that also returns the hidden state.

        `loose`: extra tokens (indices into `extra`) whose rows decide nothing (lookahead's Jacobi
        guesses): they attend in one batched call, not one at a time (see `prompt_length`).

        The cache then also holds the extra tokens: call `keep` (or `rollback`) before the next forward.
        """
        hidden, _ = self._extend(seq, extra, offsets, visibility, loose, ())
        hidden = hidden[-1 - len(extra) :]  # (1+n, H)
        return self._logits(hidden), hidden

    @torch.inference_mode()
    def forward_features(
        self,
        seq: list[int],
        taps: tuple[int, ...],
        extra: list[int] = (),
        offsets: list[int] = (),
        visibility: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_hidden`'s forward for an EAGLE-3 target: logits (1 + n, V) as there, and the
        residual stream after `taps` decoder layers each (id k: transformers' hidden_states[k], vLLM's
        aux layer id k; 0 <= k < layers), concatenated in tap order, for EVERY row fed, seq's unseen
        tokens then the extra ones: (c + n, len(taps)·H). The drafter reads each new position's."""
        layers = self.model.config.num_hidden_layers
        assert taps and all(0 <= k < layers for k in taps), f"taps {taps} must lie in 0..{layers - 1}"
        hidden, features = self._extend(seq, extra, offsets, visibility, (), tuple(taps))
        return self._logits(hidden[-1 - len(extra) :]), features

    def _extend(self, seq, extra, offsets, visibility, loose, taps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of `forward_hidden`: final hidden states (c + n, H) and tapped features of every row fed."""
        chain = seq[self.length :]
        assert chain, "forward needs at least one token the cache has not seen"
        past, c, n = self.length, len(chain), len(extra)
        positions = list(range(past, past + c)) + [past + c - 1 + o for o in offsets]
        allowed = None
        if n:
            allowed = torch.zeros(c + n, past + c + n, dtype=torch.bool)
            allowed[:, : past + c] = True
            allowed[:c, : past + c] = causal_after(past, c)
            allowed[c:, past + c :] = visibility
        elif c > 1:
            allowed = causal_after(past, c)
        rows = tuple(c + i for i in loose)
        out = self.backend.run(chain + list(extra), positions, past, allowed, rows, taps)
        self.length = past + c + n
        self.forwards += 1
        return out

    @torch.inference_mode()
    def forward_branches(
        self, seq: list[int], branches: list[tuple[int, list[int]]], logits_to_keep: int
    ) -> torch.Tensor:
        """Feed `seq[self.length:]` causally, then each branch (anchor, ids): ids placed right after
        seq[anchor] (positions anchor+1, anchor+2, …), seeing seq[: anchor+1] and their own branch's
        earlier tokens only; nothing sees a branch but itself. Returns logits (n, V): seq's last
        `logits_to_keep` positions, then every branch token in order.

        The cache then also holds the branches (after seq): `rollback` before the next forward.
        """
        chain = seq[self.length :]
        assert chain, "forward needs at least one token the cache has not seen"
        past, c = self.length, len(chain)
        ids, positions = list(chain), list(range(past, past + c))
        for anchor, tokens in branches:
            assert 0 <= anchor < past + c, "a branch hangs off a token of seq"
            ids += tokens
            positions += range(anchor + 1, anchor + 1 + len(tokens))
        total = len(ids)
        allowed = torch.zeros(total, past + total, dtype=torch.bool)
        allowed[:c, : past + c] = causal_after(past, c)
        row = c
        for anchor, tokens in branches:
            n = len(tokens)
            allowed[row : row + n, : anchor + 1] = True
            allowed[row : row + n, past + row : past + row + n] = causal(n)
            row += n
        hidden, _ = self.backend.run(ids, positions, past, allowed)
        self.length = past + total
        self.forwards += 1
        return self._logits(torch.cat([hidden[c - logits_to_keep : c], hidden[c:]]))

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the cache up to `start`, then only the entries at start + r for r in rows (in order)."""
        if list(rows) != list(range(len(rows))):  # move the kept entries into place; the prefix stays put
            with torch.inference_mode():  # the cache's tensors were made in inference mode
                self.backend.keep(start, list(rows))
        self.rollback(start + len(rows))

    def rollback(self, length: int) -> None:
        """Forget the cached key/values of every position >= `length`."""
        if length < self.length:
            self.backend.rollback(length, self.length)
            self.length = length
