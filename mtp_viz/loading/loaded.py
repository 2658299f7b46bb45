"""A loaded model and its record: what was loaded, from where, and what the pipeline applied to it
(the weight format, where its codes came from, why `auto` chose it, the kernel path), so that
nothing later has to probe the modules to find out. And the two questions callers ask of one:
a prompt's token ids, and the vocabulary a target shares with its draft."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from mtp_viz.errors import IncompatibleDraftError, UserError
from mtp_viz.kernels import Plan
from mtp_viz.weights import FP32


@dataclass(frozen=True)
class LoadedModel:
    name: str  # registry id or local path, as the user named it
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    chat: bool
    eos_token_ids: frozenset[int]
    source: str  # where the weights came from, for the trace and the logs
    weights: str = FP32  # the weight format (mtp_viz.weights)
    weights_detail: str = FP32  # the format as the records describe it (where q4's codes came from)
    linear: str = "F.linear"  # how its linear layers compute (mtp_viz.kernels, mtp_viz.row_plan)
    plan: Plan | None = None  # the kernel plan of its float32 linears (None: F.linear)
    weights_why: str | None = None  # what `auto` chose on this machine and why, when it was asked

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")


def eos_ids(generation: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids that end generation: the generation config's, and the tokenizer's EOS."""
    eos = generation.eos_token_id if generation is not None else None
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Tokenized(Protocol):
    """What encoding a prompt reads of a model: a LoadedModel, or a served target's tokenizer."""

    name: str
    tokenizer: PreTrainedTokenizerBase | None
    chat: bool


def encode_prompt(loaded: Tokenized, prompt: str, raw: bool = False) -> list[int]:
    """Prompt text → token ids, through the chat template unless `raw` or the model has none."""
    return encode_chat(loaded, ({"role": "user", "content": prompt},), raw)


def encode_chat(loaded: Tokenized, messages: Sequence[dict], raw: bool = False) -> list[int]:
    """A chat so far (ending with the user's turn) → token ids, through the chat template unless
    `raw` or the model has none (then the turns' texts, a blank line apart)."""
    if loaded.tokenizer is None:
        raise UserError(f"model {loaded.name} has no tokenizer; pass token ids instead of text")
    tok = loaded.tokenizer
    if loaded.chat and not raw and tok.chat_template:
        ids = tok.apply_chat_template(list(messages), add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        return [int(t) for t in ids]
    return tok("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]


def shared_vocab_size(target: LoadedModel, draft: LoadedModel) -> int:
    """The vocabulary size both models score, or IncompatibleDraftError when they don't share one."""
    vt, vd = target.model.config.vocab_size, draft.model.config.vocab_size
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise IncompatibleDraftError(
                f"draft {draft.name} has a different vocabulary from target {target.name}; "
                "speculative decoding needs a draft with the same tokenizer"
            )
    elif vt != vd:
        raise IncompatibleDraftError(
            f"draft {draft.name} (vocab {vd}) and target {target.name} (vocab {vt}) do not share a vocabulary"
        )
    return min(vt, vd)
