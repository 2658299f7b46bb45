"""llama.cpp in a process of its own: `python -m mtp_viz.llama_worker SPEC`, started and talked to
by mtp_viz.llama_peers, so that a native crash (an illegal instruction, a segfault) or a hang
ends this process and never the one running the benchmark or the UI.

SPEC is JSON: {"gguf", "n_ctx", "threads", "lookup": null | {"max_ngram_size", "num_pred_tokens"},
"warm_up": a request}. The worker loads the model, decodes the warm-up untimed, then writes
{"ready": true, "system_info": "..."}. Each request after that is one line on stdin,
{"prompt_ids", "max_new_tokens", "eos"}, answered by one line, {"tokens", "wall_time_s"}, the time
taken here, from the prompt's evaluation to the last token. The answers go to the process's
original stdout; anything llama.cpp prints goes to stderr. The worker ends at the end of its
stdin, and by itself once its parent is gone."""

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
        logits_all=drafter is not None,  # a drafter needs every position's logits; unset, past 512 tokens it fails
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
    start = time.perf_counter()
    tokens = greedy(llm, request["prompt_ids"], request["max_new_tokens"], frozenset(request["eos"]))
    return {"tokens": tokens, "wall_time_s": time.perf_counter() - start}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
