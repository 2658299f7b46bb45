"""Record the vLLM responses the parser tests read: run from the repository root with .venv-vllm
installed (`bash scripts/setup.sh --vllm`), one strategy at a time (each starts a server):

    .venv/bin/python tests/data/vllm/record.py prompt_lookup
    .venv/bin/python tests/data/vllm/record.py speculative

It writes `<strategy>-greedy.sse` (the streamed response, one server-sent event a line),
`<strategy>-request.json` (the request body and server arguments) and `<strategy>-metrics-before.txt`,
`-after.txt` (/metrics around the request) beside this file."""

import json
import sys
import time
from pathlib import Path

import httpx

from mtp_viz.runner import RunRequest
from mtp_viz.serving.backend import open_server, plan, prompt_ids, request_body
from mtp_viz.strategies.base import GenerationSettings

HERE = Path(__file__).resolve().parent
PROMPT = "Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries."


def main(strategy: str) -> None:
    p = plan(RunRequest(prompt=PROMPT, strategy=strategy, generation=GenerationSettings(max_new_tokens=48)))
    body = request_body(p, prompt_ids(p))
    with open_server(p, progress=lambda m: print(m, file=sys.stderr)) as server, httpx.Client() as client:
        client.post(f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=300)
        time.sleep(1)
        before = httpx.get(f"{server.url}/metrics").text
        with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            lines = list(r.iter_lines())
        time.sleep(1)  # counters are published after the response
        metrics = httpx.get(f"{server.url}/metrics").text
        args = server.args
    (HERE / f"{strategy}-greedy.sse").write_text("\n".join(lines) + "\n")
    (HERE / f"{strategy}-request.json").write_text(json.dumps({"body": body, "server_args": args}, indent=1))
    (HERE / f"{strategy}-metrics-before.txt").write_text(before)
    (HERE / f"{strategy}-metrics-after.txt").write_text(metrics)


if __name__ == "__main__":
    main(sys.argv[1])
