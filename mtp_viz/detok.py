"""Token ids → the text each token adds, for streaming and for the token view.

Decoding one token alone loses leading spaces (SentencePiece) and splits multi-byte characters
(byte-level BPE). Like text-generation-inference, we decode a short window and take the
difference; a token that ends inside a character adds "" and the token completing it adds the
character, so the texts always concatenate to the decoded output.
"""

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"


class TextTracker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _texts(self, ids: list[int], prefix: int, read: int, new: list[int]) -> tuple[list[str], int, int]:
        ids = ids + new
        texts = []
        for end in range(len(ids) - len(new) + 1, len(ids) + 1):
            before = self._decode(ids[prefix:read])
            after = self._decode(ids[prefix:end])
            if len(after) > len(before) and not after.endswith(INCOMPLETE):
                texts.append(after[len(before) :])
                prefix, read = read, end
            else:
                texts.append("")
        return texts, prefix, read

    def commit(self, new: list[int]) -> list[str]:
        """Texts of tokens appended to the output."""
        texts, self._prefix, self._read = self._texts(self._ids, self._prefix, self._read, new)
        self._ids.extend(new)
        if self._prefix > 4 * CONTEXT_TOKENS:  # keep the window short
            cut = self._prefix
            self._ids, self._prefix, self._read = self._ids[cut:], 0, self._read - cut
        return texts

    def peek(self, new: list[int]) -> list[str]:
        """Texts tokens would have if appended now (drafted tokens, accepted or not)."""
        return self._texts(self._ids, self._prefix, self._read, new)[0]
