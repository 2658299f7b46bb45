"""llama.cpp in a process of its own: `python -m mtp_viz.llama_worker SPEC`, started and talked to
by mtp_viz.llama_peers, so that a native crash (an illegal instruction, a segfault) or a hang
ends this process and never the one running the benchmark or the UI.

SPEC is JSON: {"gguf", "n_ctx", "threads", "lookup": null | {"max_ngram_size", "num_pred_tokens"},
"logits_all": whether every row's logits are kept, "warm_up": a request}. The worker loads the
model, decodes the warm-up untimed, then writes {"ready": true, "system_info": "..."}. Each
request after that is one line on stdin, answered by one line:
- a completion, {"prompt_ids", "max_new_tokens", "eos"} → {"tokens", "wall_time_s"}, the time
  taken here, from the prompt's evaluation to the last token;
- a verify timing, {"context_ids", "new_ids", "ks", "rounds"} → {"seconds": {k: [s, ...]},
  "rows": {k: each row's top token}, "n_tokens"} (`verify`: llama.cpp's own k-row curve).
The answers go to the process's original stdout; anything llama.cpp prints goes to stderr. The
worker ends at the end of its stdin, and by itself once its parent is gone."""

import faulthandler
import json
import os
import sys
import time

from mtp_viz.child import exit_with_parent


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


def load(spec: dict):
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = spec.get("lookup")
    drafter = LlamaPromptLookupDecoding(lookup["max_ngram_size"], lookup["num_pred_tokens"]) if lookup else None
    return llama_cpp.Llama(
        model_path=spec["gguf"],
        n_ctx=spec["n_ctx"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        draft_model=drafter,
        # a drafter needs every position's logits (unset, past 512 tokens it fails), a verify every row's
        logits_all=drafter is not None or bool(spec.get("logits_all")),
        seed=0,
        verbose=False,
    )


def main(argv: list[str]) -> int:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # native prints must not reach the answers
    faulthandler.enable()  # a fatal signal names where it struck, on stderr
    exit_with_parent()
    spec = json.loads(argv[0])
    import llama_cpp

    llm = load(spec)
    answer(llm, spec["warm_up"])  # untimed: the thread pool, page faults of the mapped file
    answers.write(json.dumps({"ready": True, "system_info": llama_cpp.llama_print_system_info().decode()}) + "\n")
    for line in sys.stdin:
        answers.write(json.dumps(answer(llm, json.loads(line))) + "\n")
    llm.close()
    return 0


def answer(llm, request: dict) -> dict:
    if "ks" in request:
        return verify(llm, request["context_ids"], request["new_ids"], request["ks"], request["rounds"])
    start = time.perf_counter()
    tokens = greedy(llm, request["prompt_ids"], request["max_new_tokens"], frozenset(request["eos"]))
    return {"tokens": tokens, "wall_time_s": time.perf_counter() - start}


def verify(llm, context_ids: list[int], new_ids: list[int], ks: list[int], rounds: int) -> dict:
    """What evaluating k new tokens after a fixed context costs llama.cpp, every row's logits
    computed (a verify reads each): the context is evaluated once (kept from the previous request
    when it is the same), then, `rounds` times, for each k the first k of `new_ids` are evaluated,
    timed, and removed from the KV cache again, so that every timed evaluation starts at the same
    length. Also each row's top token (what it scored) and the cached length left at the end."""
    n = len(context_ids)
    if llm.n_tokens != n or llm.input_ids[:n].tolist() != context_ids:
        llm.reset()
        llm.eval(context_ids)
    seconds: dict[int, list[float]] = {k: [] for k in ks}
    rows: dict[int, list[int]] = {}
    for _ in range(rounds):
        for k in ks:
            start = time.perf_counter()
            llm.eval(new_ids[:k])
            seconds[k].append(time.perf_counter() - start)
            rows[k] = llm.scores[n : n + k].argmax(axis=-1).tolist()
            forget(llm, n)
    return {"seconds": seconds, "rows": rows, "n_tokens": llm.n_tokens}


def forget(llm, length: int) -> None:
    """Drop every cached position from `length` on, from llama.cpp's KV cache and from the tokens
    llama-cpp-python counts as evaluated."""
    import llama_cpp

    if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), -1, length, -1):
        raise RuntimeError(f"llama.cpp could not remove the cached positions from {length} on")
    llm.n_tokens = length


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
