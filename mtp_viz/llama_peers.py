"""llama.cpp as a CPU peer: the GGUF our engine dequantizes, run at its own bits by llama.cpp
(llama-cpp-python, installed by `bash scripts/setup.sh --llama`), on the same prompt token ids,
greedy, with as many threads as ours. Anyone running a GGUF on a CPU compares with it.

Two peers: plain decoding, and llama-cpp-python's prompt-lookup drafter
(`LlamaPromptLookupDecoding`, in Python, given our draft length and longest n-gram; it always
falls back to 1-gram matches and, as shipped, keeps the logits of every position, the prompt's
included). Its greedy tokens are not always ours: llama.cpp rounds activations to 8 bits (ggml's
Q8_1) for its Q4_1 products where our engine multiplies in fp32 on the dequantized weights, so
logits differ by ~0.1 (measured) and the two part at near-ties (`parting` says where and by how
much). Optional: where llama_cpp is not installed, or the model ships no GGUF, `unavailable()` is
the one line that says so and the benchmarks skip these peers with it."""

import contextlib
import importlib.util
import math
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import PreTrainedModel

from mtp_viz.clock import Clock
from mtp_viz.errors import UserError
from mtp_viz.labels import LLAMA_CPP_PREFIX
from mtp_viz.models import LoadedModel
from mtp_viz.peers import PeerRun
from mtp_viz.quality import first_divergence
from mtp_viz.registry import load_registry
from mtp_viz.strategies.prompt_lookup import PromptLookupSettings

LLAMA_CPP_AUTOREGRESSIVE = LLAMA_CPP_PREFIX + "autoregressive"
LLAMA_CPP_PROMPT_LOOKUP = LLAMA_CPP_PREFIX + "prompt_lookup"
LLAMA_CPP_PEERS = (LLAMA_CPP_AUTOREGRESSIVE, LLAMA_CPP_PROMPT_LOOKUP)
INSTALL = "bash scripts/setup.sh --llama"
MIN_CONTEXT = 1024  # tokens; a context grows to the next power of two a prompt needs
WARM_UP_TOKENS = 4  # decoded untimed after each (re)load: thread pool, page faults of the mapped file


def unavailable(model: str) -> str | None:
    """None when the llama.cpp peers can run on `model`, else the one line that says why they are skipped."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama.cpp peers skipped: llama-cpp-python is not installed ({INSTALL})"
    if shipped_gguf(model) is None:
        return f"llama.cpp peers skipped: model {model} ships no GGUF here (they run on the same GGUF as ours)"
    return None


def shipped_gguf(model: str) -> Path | None:
    """The GGUF file a registered model ships as (its `gguf_wheel` source), if installed."""
    try:
        sources = load_registry().get(model).sources
    except UserError:  # a local model directory
        return None
    for source in sources:
        if source.kind == "gguf_wheel":
            spec = importlib.util.find_spec(source.package)
            if spec is not None and spec.submodule_search_locations:
                path = Path(spec.submodule_search_locations[0]) / source.file
                if path.is_file():
                    return path
    return None


class LlamaCppPeers(contextlib.ExitStack):
    """`with LlamaCppPeers(names, target, threads) as peers: peers.run(name, prompt_ids, max_new)`.

    One llama.cpp context per peer on the target's shipped GGUF, closed on exit."""

    def __init__(self, names: list[str], target: LoadedModel, threads: int, lookup: PromptLookupSettings | None = None):
        super().__init__()
        unknown = [n for n in names if n not in LLAMA_CPP_PEERS]
        if unknown:
            raise UserError(f"unknown llama.cpp peer {', '.join(unknown)}; choose from {', '.join(LLAMA_CPP_PEERS)}")
        if names and (why := unavailable(target.name)):
            raise UserError(why)
        self.names, self.target, self.threads = names, target, threads
        self.gguf = shipped_gguf(target.name) if names else None
        self.lookup = lookup or PromptLookupSettings()
        self.contexts: dict[str, object] = {}  # peer → llama_cpp.Llama
        self.callback(self._close_all)

    def run(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        """One greedy completion of the prompt ids, timed from the prompt's evaluation to the last token."""
        llm = self._context(name, len(prompt_ids) + max_new_tokens)
        clock = Clock("cpu")
        start = clock.now()
        out = greedy(llm, prompt_ids, max_new_tokens, self.target.eos_token_ids)
        wall = clock.now() - start
        text = self.target.tokenizer.decode(out, skip_special_tokens=False) if self.target.tokenizer else ""
        return PeerRun(name, out, text, wall, self.machine())

    def machine(self) -> dict:
        """What the llama.cpp runs were measured with, for the bench record's machine line."""
        import llama_cpp

        features = llama_cpp.llama_print_system_info().decode()
        return {
            "engine": "llama.cpp",
            "llama_cpp_python": version("llama_cpp_python"),
            "threads": self.threads,
            "gguf": self.gguf.name if self.gguf else None,
            "cpu_features": _enabled(features),
            "prompt_lookup": {
                "num_pred_tokens": self.lookup.num_draft_tokens,
                "max_ngram_size": self.lookup.max_ngram_size,
            },
        }

    def _context(self, name: str, needed: int):
        """The peer's llama.cpp context, (re)loaded with room for `needed` tokens and warmed up."""
        llm = self.contexts.get(name)
        if llm is not None and llm.n_ctx() >= needed:
            return llm
        if llm is not None:
            llm.close()
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        drafter = None
        if name == LLAMA_CPP_PROMPT_LOOKUP:
            drafter = LlamaPromptLookupDecoding(self.lookup.max_ngram_size, self.lookup.num_draft_tokens)
        llm = llama_cpp.Llama(
            model_path=str(self.gguf),
            n_ctx=max(MIN_CONTEXT, 2 ** math.ceil(math.log2(needed))),
            n_threads=self.threads,
            n_threads_batch=self.threads,
            draft_model=drafter,
            logits_all=drafter is not None,  # a drafter needs every position's logits; unset, past 512 tokens it fails
            seed=0,
            verbose=False,
        )
        greedy(llm, [self.target.tokenizer.bos_token_id or 0], WARM_UP_TOKENS, frozenset())
        self.contexts[name] = llm
        return llm

    def _close_all(self) -> None:
        for llm in self.contexts.values():
            llm.close()
        self.contexts.clear()


def greedy(llm, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: frozenset[int]) -> list[int]:
    """Greedy decoding on a fresh KV cache (no prefix reuse from an earlier call), up to and
    including the first end-of-sequence token."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if token in eos_token_ids or len(out) >= max_new_tokens:
            break
    return out


@torch.inference_mode()
def parting(
    model: PreTrainedModel, prompt_ids: list[int], ours: list[int], theirs: list[int]
) -> tuple[int, float] | None:
    """Where llama.cpp's greedy tokens first differ from ours, and by how many logits our model
    preferred its own token there (a near-tie when small); None when they never differ."""
    i = first_divergence(ours, theirs)
    if i is None:
        return None
    if i >= min(len(ours), len(theirs)):  # one stopped earlier
        return i, float("nan")
    logits = model(torch.tensor([prompt_ids + ours[:i]], device=model.device), logits_to_keep=1).logits[0, -1]
    return i, float(logits[ours[i]] - logits[theirs[i]])


def _enabled(system_info: str) -> str:
    """llama.cpp's "CPU : SSE3 = 1 | AVX = 1 | AVX512 = 1 | ..." → "SSE3 AVX AVX512 ..."."""
    names = [
        part.split("=")[0].split(":")[-1].strip() for part in system_info.split("|") if part.strip().endswith("= 1")
    ]
    return " ".join(names)
