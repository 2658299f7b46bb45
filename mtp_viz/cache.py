"""A model with its own KV cache that can be extended and rolled back.

Every strategy keeps one `CachedModel` per model it runs. The cache holds the key/values of the
first `length` tokens of the sequence the strategy is building; `forward(seq)` feeds whatever of
`seq` the cache has not seen yet (the whole prompt on the first call), and `rollback(n)` forgets
everything after position n, e.g. the rejected part of a draft block.
"""

import torch
from transformers import DynamicCache, PreTrainedModel


class CachedModel:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None):
        self.model = model
        self.device = model.device
        self.vocab_size = vocab_size or model.config.vocab_size
        self.cache = DynamicCache(config=model.config)
        self.length = 0  # tokens whose key/values are cached
        self.forwards = 0

    @torch.inference_mode()
    def forward(self, seq: list[int], logits_to_keep: int = 1) -> torch.Tensor:
        """Feed `seq[self.length:]`; return logits of its last `logits_to_keep` positions: (n, V)."""
        new = seq[self.length :]
        assert new, "forward needs at least one token the cache has not seen"
        logits_to_keep = min(logits_to_keep, len(new))
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # (1, S)
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.length = len(seq)
        self.forwards += 1
        return out.logits[0, :, : self.vocab_size].float()  # (logits_to_keep, V)

    def rollback(self, length: int) -> None:
        """Forget the cached key/values of every position >= `length`."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length
