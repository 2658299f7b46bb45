"""The app under load, as a hosted Space meets it: memory over repeated runs, then many concurrent
API users. A benchmark, not a test: it prints what it measured.

    .venv/bin/python benchmarks/load.py [--users 16] [--requests 3] [--repeated 50] [--max-new-tokens 24] [--bursts 1]
        [--strategies autoregressive,prompt_lookup,speculative,mtp_heads]

1. Memory: one user runs `--repeated` requests in a row (the strategies in turn); the server's
   resident memory is read after the warm-up, after the first 10 and at the end.
2. Load: `--users` gradio_client users at once, each sending `--requests` requests (mixed
   strategies and prompts) to the `/run` endpoint. Reports errors, throughput (requests/s and
   generated tokens/s over the whole load) and latency percentiles (request sent → trace back,
   so queueing included), and checks every greedy result against the same request made alone.

Requests go to the app's default model; `--strategies` picks what they cycle through (the default
needs the model's registered draft and MTP heads). Its figures are in docs/BENCHMARKS.md, "The
app under load (issue 7)"; logs in docs/results/load-bench*.log.
"""

import argparse
import json
import statistics
import threading
import time

from served import rss_mb, served_app

from mtp_viz.loading import quiet_transformers

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that reverses a string.",
    "List three uses of copper.",
    "Translate to French: the cat sleeps on the warm windowsill.",
]
STRATEGIES = "autoregressive,prompt_lookup,speculative,mtp_heads"  # speculative, mtp_heads: the registry's trained ones
MEMORY_AFTER = 10  # runs after which resident memory is read a second time (or all of them, if fewer)


def _job(i: int, max_new_tokens: int, strategies: list[str]) -> dict:
    strategy = strategies[(i // len(PROMPTS)) % len(strategies)]
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": max_new_tokens, "strategy": strategy}


def _key(job: dict) -> str:
    return json.dumps(job, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3, help="per user")
    parser.add_argument("--repeated", type=int, default=50, help="runs in a row for the memory figure")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--bursts", type=int, default=1, help="how many times to run the concurrent load")
    parser.add_argument("--port", type=int, default=7862)
    parser.add_argument("--strategies", default=STRATEGIES, help="comma-separated; requests cycle through them")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    if args.repeated < 1:
        parser.error("--repeated must be at least 1")
    mark = min(MEMORY_AFTER, args.repeated)
    quiet_transformers()
    with served_app(args.port) as (server, url, client):
        from gradio_client import Client

        def call(c, job):
            return c.predict(**job, api_name="/run")

        alone = {}
        for i in range(len(PROMPTS) * len(strategies)):  # warm-up: loads every model; every distinct job once
            job = _job(i, args.max_new_tokens, strategies)
            alone[_key(job)] = call(client, job)["output_token_ids"]
        rss = [rss_mb(server.pid)]
        for i in range(args.repeated):
            call(client, _job(i, args.max_new_tokens, strategies))
            if i == mark - 1:
                rss.append(rss_mb(server.pid))
        rss.append(rss_mb(server.pid))

        latencies, tokens, errors, mismatches = [], [], [], []
        lock = threading.Lock()

        clients = [Client(url, verbose=False) for _ in range(args.users)]  # one session per user, kept

        def user(u: int) -> None:
            own = clients[u]
            for r in range(args.requests):
                job = _job(u + r, args.max_new_tokens, strategies)
                start = time.perf_counter()
                try:
                    out = call(own, job)["output_token_ids"]
                except Exception as e:  # noqa: BLE001 - counted and printed
                    with lock:
                        errors.append(repr(e))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - start)
                    tokens.append(len(out))
                    if out != alone[_key(job)]:
                        mismatches.append(job)

        elapsed = 0.0
        for _ in range(args.bursts):  # the same load again: memory should level off, not climb
            threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed += time.perf_counter() - start
            rss.append(rss_mb(server.pid))

    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    print(f"memory (server RSS, MiB): after warm-up {rss[0]:.0f}, after {mark} runs {rss[1]:.0f},")
    print(
        f"  after {args.repeated} runs {rss[2]:.0f} (growth {rss[2] - rss[0]:+.0f} MiB; "
        f"{rss[2] - rss[1]:+.0f} over the last {args.repeated - mark}), after each load burst "
        + ", ".join(f"{r:.0f}" for r in rss[3:])
    )
    print(
        f"load: {args.bursts} burst(s) of {args.users} users x {args.requests} requests, "
        f"{args.max_new_tokens} new tokens each: "
        f"{len(latencies)} ok, {len(errors)} errors, {len(mismatches)} results differ from the same request alone"
    )
    print(
        f"  throughput {len(latencies) / elapsed:.2f} requests/s, {sum(tokens) / elapsed:.1f} generated tokens/s "
        f"over {elapsed:.1f} s"
    )
    print(
        f"  latency (queueing included) p50 {q[49]:.2f} s, p90 {q[89]:.2f} s, p99 {q[98]:.2f} s, "
        f"max {max(latencies):.2f} s"
    )
    for e in errors[:5]:
        print("  error:", e)


if __name__ == "__main__":
    main()
