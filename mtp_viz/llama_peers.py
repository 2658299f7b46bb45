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
the one line that says so and the benchmarks skip these peers with it.

Beside the peers, `LlamaCppPeers.verify_times` measures llama.cpp's own verify-cost curve: k new
tokens evaluated after a fixed context, every row's logits computed, removed again each time."""

import contextlib
import importlib.util
import json
import math
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import PreTrainedModel

from mtp_viz.child import exit_reason
from mtp_viz.errors import UserError
from mtp_viz.labels import LLAMA_CPP_PREFIX
from mtp_viz.loading import LoadedModel
from mtp_viz.peers import PeerRun
from mtp_viz.quality import first_divergence
from mtp_viz.registry import load_registry
from mtp_viz.strategies.prompt_lookup import PromptLookupSettings

LLAMA_CPP_AUTOREGRESSIVE = LLAMA_CPP_PREFIX + "autoregressive"
LLAMA_CPP_PROMPT_LOOKUP = LLAMA_CPP_PREFIX + "prompt_lookup"
LLAMA_CPP_PEERS = (LLAMA_CPP_AUTOREGRESSIVE, LLAMA_CPP_PROMPT_LOOKUP)
LLAMA_CPP_VERIFY = LLAMA_CPP_PREFIX + "verify"  # the worker that times k-row evaluations (not a bench peer)
INSTALL = "bash scripts/setup.sh --llama"
MIN_CONTEXT = 1024  # tokens; a context grows to the next power of two a prompt needs
WARM_UP_TOKENS = 4  # decoded untimed after each (re)load: thread pool, page faults of the mapped file
WORKER = [sys.executable, "-m", "mtp_viz.llama_worker"]  # the process a peer runs in
START_TIMEOUT_S = 180.0  # load the GGUF and warm up (seconds on 2 cores)
ANSWER_TIMEOUT_S = 120.0  # a completion: this, plus SECONDS_PER_TOKEN a token asked for (it runs 60-90 tok/s here)
SECONDS_PER_TOKEN = 1.0
STOP_GRACE_S = 10.0


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


class PeerFailed(UserError):
    """A llama.cpp peer's process died, hung or could not start: one line that says which and how."""


class LlamaCppPeers(contextlib.ExitStack):
    """`with LlamaCppPeers(names, target, threads) as peers: peers.run(name, prompt_ids, max_new)`.

    Each peer is llama.cpp in a process of its own (mtp_viz.llama_worker) on the target's shipped
    GGUF, so a native crash or a hang is a `PeerFailed` line here, never our process's end; the
    processes are stopped on exit, and stop by themselves if we die."""

    def __init__(self, names: list[str], target: LoadedModel, threads: int, lookup: PromptLookupSettings | None = None):
        super().__init__()
        unknown = [n for n in names if n not in LLAMA_CPP_PEERS]
        if unknown:
            raise UserError(f"unknown llama.cpp peer {', '.join(unknown)}; choose from {', '.join(LLAMA_CPP_PEERS)}")
        if names and (why := unavailable(target.name)):
            raise UserError(why)
        self.names, self.target, self.threads = names, target, threads
        self.gguf = shipped_gguf(target.name)
        self.lookup = lookup or PromptLookupSettings()
        self.workers: dict[str, Worker] = {}  # peer → its llama.cpp process
        self.system_info = ""  # llama.cpp's own line of CPU features, from the first worker
        self.callback(self._close_all)

    def run(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> PeerRun:
        """One greedy completion of the prompt ids, timed in the worker from the prompt's
        evaluation to the last token. Raises PeerFailed if the worker dies or hangs."""
        worker = self._worker(name, len(prompt_ids) + max_new_tokens)
        asked = request(prompt_ids, max_new_tokens, self.target.eos_token_ids)
        answer = worker.ask(asked, answer_timeout(max_new_tokens))
        out = answer["tokens"]
        text = self.target.tokenizer.decode(out, skip_special_tokens=False) if self.target.tokenizer else ""
        return PeerRun(name, out, text, answer["wall_time_s"], self.machine())

    def verify_times(self, context_ids: list[int], new_ids: list[int], ks: list[int], rounds: int = 1) -> "VerifyTimes":
        """llama.cpp's own k-row costs on this machine: for each k in `ks`, the first k of `new_ids`
        evaluated after `context_ids` (evaluated once), every row's logits computed, timed in its
        worker and removed from its KV cache again, `rounds` times. Raises PeerFailed if the worker
        dies or hangs, UserError where llama.cpp cannot run this model."""
        if why := unavailable(self.target.name):
            raise UserError(why)
        if not ks or min(ks) < 1 or max(ks) > len(new_ids):
            raise UserError(f"verify sizes {ks} must lie in 1..{len(new_ids)} (the new tokens given)")
        worker = self._worker(LLAMA_CPP_VERIFY, len(context_ids) + max(ks))
        asked = {"context_ids": list(context_ids), "new_ids": list(new_ids[: max(ks)]), "ks": list(ks)}
        answer = worker.ask(asked | {"rounds": rounds}, answer_timeout(rounds * sum(ks)))
        return VerifyTimes(
            {int(k): v for k, v in answer["seconds"].items()},
            {int(k): v for k, v in answer["rows"].items()},
            answer["n_tokens"],
        )

    def machine(self) -> dict:
        """What the llama.cpp runs were measured with, for the bench record's machine line."""
        return {
            "engine": "llama.cpp",
            "llama_cpp_python": version("llama_cpp_python"),
            "threads": self.threads,
            "gguf": self.gguf.name if self.gguf else None,
            "cpu_features": _enabled(self.system_info),
            "prompt_lookup": {
                "num_pred_tokens": self.lookup.num_draft_tokens,
                "max_ngram_size": self.lookup.max_ngram_size,
            },
        }

    def _worker(self, name: str, needed: int) -> "Worker":
        """The peer's llama.cpp process, (re)started with room for `needed` tokens and warmed up."""
        worker = self.workers.pop(name, None)
        if worker is not None and worker.n_ctx >= needed:
            self.workers[name] = worker
            return worker
        if worker is not None:
            worker.close()
        lookup = None
        if name == LLAMA_CPP_PROMPT_LOOKUP:
            lookup = {"max_ngram_size": self.lookup.max_ngram_size, "num_pred_tokens": self.lookup.num_draft_tokens}
        spec = {
            "gguf": str(self.gguf),
            "n_ctx": max(MIN_CONTEXT, 2 ** math.ceil(math.log2(needed))),
            "threads": self.threads,
            "lookup": lookup,
            "logits_all": name == LLAMA_CPP_VERIFY,
            "warm_up": request([self.target.tokenizer.bos_token_id or 0], WARM_UP_TOKENS, frozenset()),
        }
        worker = self.workers[name] = Worker(f"llama.cpp {name.removeprefix(LLAMA_CPP_PREFIX)}", spec)
        self.system_info = self.system_info or worker.ready["system_info"]
        return worker

    def _close_all(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()


@dataclass(frozen=True)
class VerifyTimes:
    """llama.cpp's timed evaluations of k new tokens after a fixed context (`verify_times`)."""

    seconds: dict[int, list[float]]  # k → the seconds of each timed evaluation
    rows: dict[int, list[int]]  # k → each row's top token (its greedy choice for the next position)
    n_tokens: int  # the length cached afterwards: the context's, each evaluation removed again


def request(prompt_ids: list[int], max_new_tokens: int, eos_token_ids: frozenset[int]) -> dict:
    return {"prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens, "eos": sorted(eos_token_ids)}


def answer_timeout(max_new_tokens: int) -> float:
    return ANSWER_TIMEOUT_S + SECONDS_PER_TOKEN * max_new_tokens


class Worker:
    """One llama.cpp process (WORKER): started, asked one JSON line at a time, always stopped.
    A death, a silence past the timeout or an unreadable answer is a PeerFailed naming `label`,
    and the process is stopped."""

    def __init__(self, label: str, spec: dict, start_timeout_s: float = START_TIMEOUT_S):
        self.label, self.n_ctx = label, spec["n_ctx"]
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (read on failure, gone with the worker)
        self.process = subprocess.Popen(
            [*WORKER, json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"{label} answers", daemon=True).start()
        self.ready = self._answer(start_timeout_s, "starting")

    def ask(self, request: dict, timeout_s: float) -> dict:
        with contextlib.suppress(OSError):  # it died: the missing answer says how
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        return self._answer(timeout_s, "decoding")

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout_s: float, doing: str) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
            if line is None:
                why = f"{exit_reason(self.process.wait())} while {doing}: {self.last_error()}"
            else:
                with contextlib.suppress(ValueError):
                    return json.loads(line)
                why = f"answered something unreadable while {doing}: {line[:120]!r}"
        except queue.Empty:
            why = f"gave no answer in {timeout_s:.0f} s while {doing}, and was stopped"
        except BaseException:  # Ctrl-C while waiting: stopped all the same
            self.close()
            raise
        self.close()
        raise PeerFailed(f"{self.label} {why}")

    def last_error(self) -> str:
        """The telling line of the worker's stderr: a fatal error, else its last line."""
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        fatal = [line for line in lines if line.startswith("Fatal Python error")]
        return (fatal or lines or ["(nothing on stderr)"])[-1][:300]

    def close(self) -> None:
        """Stop the process: the end of its input, then a kill if it does not end by itself."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()


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
