"""How fast vLLM's CPU server makes training data: prefill and decode step at B concurrent requests.

    nice .venv/bin/python experiments/corpus_throughput.py 2>&1 | tee docs/results/corpus-throughput.log

For each setting (vLLM's defaults, which keep one core for the scheduler; every core the worker's,
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`, as `train corpus` runs it) one server of the embedded target
(.venv-vllm, float32), then B greedy completions of `--new` tokens (`ignore_eos`) sent at once, for
each prompt length: a prompt of P synthetic ids, so every request decodes the same steps. The last
request's first token ends the prefill (B·P tokens over that time); the rest of the wall time over
the decode steps is a step. One variable at a time, as the table in docs/training.md ("How fast the
serving engine makes data here") reports them.
"""

import argparse
import asyncio
import time
from dataclasses import replace

import httpx

from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import plan
from mtp_viz.serving.client import complete_async, completion_body
from mtp_viz.serving.server import VLLMServer
from mtp_viz.training.corpus_make import CORPUS_SERVER_ENV

SETTINGS = {
    "vLLM's defaults (a core kept for its scheduler)": {"VLLM_CPU_KVCACHE_SPACE": "6"},
    "every core the worker's (train corpus)": CORPUS_SERVER_ENV,
}


async def level(url: str, name: str, prompt: int, batch: int, new: int) -> tuple[float, float, int]:
    """(prefill tok/s, seconds a decode step, tokens out) of B requests of P prompt ids sent at once."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch), timeout=1200) as client:

        async def one(i: int):
            ids = [(17 * i + 3 * k) % 40000 + 100 for k in range(prompt)]  # distinct: no prefix caching
            return await complete_async(client, url, {**completion_body(name, ids, new), "ignore_eos": True})

        start = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(batch)))
        wall = time.perf_counter() - start
    prefill = max(c.ttft_s for c in done)
    return batch * prompt / prefill, (wall - prefill) / (new - 1), sum(len(c.token_ids) for c in done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="16,256,768", help="prompt lengths, comma-separated")
    parser.add_argument("--batches", default="32,64", help="requests in flight, comma-separated")
    parser.add_argument("--new", type=int, default=128, help="tokens each request decodes")
    args = parser.parse_args()
    base = plan(RunRequest(model="smollm2-135m"))
    print("| setting | prompt tokens | B | prefill | a decode step | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for what, env in SETTINGS.items():
        p = replace(base, server=replace(base.server, env={**base.server.env, **env}))
        server = VLLMServer.start(p.server)
        try:
            asyncio.run(level(server.url, server.served_name, 16, 4, 8))  # untimed: one-off costs of a fresh server
            for prompt in (int(x) for x in args.prompts.split(",")):
                for batch in (int(x) for x in args.batches.split(",")):
                    rate, step, _ = asyncio.run(level(server.url, server.served_name, prompt, batch, args.new))
                    print(
                        f"| {what} | {prompt} | {batch} | {rate:.0f} tok/s | {step * 1e3:.0f} ms | {batch / step:.0f} |"
                    )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
