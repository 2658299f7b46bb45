"""vLLM's advice for its CPU backend, A/B'd: tcmalloc and Intel OpenMP in LD_PRELOAD, or not.

    nice .venv/bin/python experiments/vllm_preload_ab.py autoregressive eagle | tee docs/results/vllm-preload-ab.log

vLLM's CPU worker warns that tcmalloc and libiomp5 are missing from LD_PRELOAD, and that
speculative decoding without Intel OpenMP loses much. For each strategy named (plain decoding;
`eagle`: the shipped EAGLE-3 drafter, a chain of 3) one server of the embedded target as the app
plans it, with and without `LD_PRELOAD` = Debian's libtcmalloc_minimal.so.4 (apt
libtcmalloc-minimal4) and .venv-vllm's libiomp5.so; one client, the first prompt of each Spec-Bench
category (`--prompts`), `--new` greedy tokens each, end to end (first token included). Servers run
one at a time: the first strategy without then with, the next with then without, so drift shows
as a sign flip. Needs `bash scripts/setup.sh --vllm` and the tcmalloc library.
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import httpx

from mtp_viz.loading.loaded import encode_chat
from mtp_viz.prompts import spec_bench
from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import open_server, plan
from mtp_viz.serving.client import complete, completion_body
from mtp_viz.serving.server import vllm_python

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def prompts(n: int) -> list[str]:
    seen, out = set(), []
    for q in spec_bench():
        if q["category"] not in seen:
            seen.add(q["category"])
            out.append(q["turns"][0])
    return out[:n]


def measure(strategy: str, preload: str | None, texts: list[str], new: int) -> dict:
    p = plan(RunRequest(strategy=strategy, strategy_settings={"depth": 3} if strategy == "eagle" else {}))
    env = {**p.server.env, **({"LD_PRELOAD": preload} if preload else {})}
    p = replace(p, server=replace(p.server, env=env))
    ids = [encode_chat(p.target, ({"role": "user", "content": t},)) for t in texts]
    with open_server(p) as s, httpx.Client() as client:
        complete(client, s.url, completion_body(s.served_name, ids[0], 16))  # warm
        tokens, seconds, per = 0, 0.0, []
        for i in ids:
            started = time.perf_counter()
            c = complete(client, s.url, completion_body(s.served_name, i, new))
            took = time.perf_counter() - started
            tokens, seconds = tokens + len(c.token_ids), seconds + took
            per.append(round(len(c.token_ids) / took, 1))
    return {"strategy": strategy, "preload": bool(preload), "tok_s": round(tokens / seconds, 2), "per_prompt": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("strategies", nargs="*", default=["autoregressive", "eagle"])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    iomp = vllm_python().parent.parent / "lib" / "libiomp5.so"
    for lib in (TCMALLOC, iomp):
        if not lib.is_file():
            raise SystemExit(f"{lib} missing")
    preload = f"{TCMALLOC}:{iomp}"
    texts = prompts(args.prompts)
    for n, strategy in enumerate(args.strategies):
        for on in ((False, True), (True, False))[n % 2]:
            print(json.dumps(measure(strategy, preload if on else None, texts, args.new)), flush=True)


if __name__ == "__main__":
    main()
