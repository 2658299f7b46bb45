"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for the server lifecycle tests
(the real server takes two minutes to start; tests/test_vllm_server.py starts it once).

It takes the same arguments, starts a grandchild (as vLLM starts its engine), writes the pids to
$FAKE_VLLM_PIDS, and by $FAKE_VLLM_MODE: `ok` serves /health, /v1/models and /version; `die`
exits with an error line; `segfault` dies by SIGSEGV; `hang` never becomes healthy. A completion
streams the token ids in $FAKE_VLLM_TOKENS (default 5,6,7) one per chunk, as vLLM streams plain
decoding; with FAKE_VLLM_TOKENS=hashed the ids are drawn from a hash of the request's prompt and
sampling settings, as a deterministic server answers: the same request always the same, another
prompt something else. /metrics is empty.
With $FAKE_VLLM_DIE_AFTER=N the server dies (its engine child left behind) after N completions."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

HASHED = "hashed"
HASHED_IDS = range(4, 28)  # the words of the tests' tiny vocabulary (conftest.make_tokenizer), valid in any


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def answer(request: dict) -> list[int]:
    """The token ids a completion request gets (see the module's docstring)."""
    given = os.environ.get("FAKE_VLLM_TOKENS", "5,6,7")
    if given == HASHED:
        rng = random.Random(json.dumps([request["prompt"], request.get("temperature"), request.get("seed")]))
        return [rng.choice(HASHED_IDS) for _ in range(request["max_tokens"])]
    return [int(t) for t in given.split(",")][: request["max_tokens"]]


def main() -> None:
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if os.environ.get("FAKE_VLLM_PIDS"):
        with open(os.environ["FAKE_VLLM_PIDS"], "w") as f:
            json.dump([os.getpid(), engine.pid], f)
    print("INFO starting fake vLLM", flush=True)
    if mode == "die":
        print("ValueError: the model directory holds no config.json", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(600)
    if mode == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    name = arg("--served-model-name")
    answered = [0]
    die_after = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "0"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            body = {"/health": {}, "/version": {"version": "fake"}, "/v1/models": {"data": [{"id": name}]}}
            if self.path not in body:
                self.send_error(404)
                return
            data = json.dumps(body[self.path]).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            tokens = answer(request)
            chunks = [{"choices": [{"index": 0, "text": "", "token_ids": [t], "finish_reason": None}]} for t in tokens]
            chunks[0]["choices"][0]["prompt_token_ids"] = request["prompt"]
            chunks.append({"choices": [], "usage": {"completion_tokens": len(tokens)}, "metrics": {}})
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())
            self.wfile.flush()
            answered[0] += 1
            if answered[0] == die_after:
                os._exit(1)

        def log_message(self, *args):
            pass

    HTTPServer((arg("--host"), int(arg("--port"))), Handler).serve_forever()


if __name__ == "__main__":
    main()
