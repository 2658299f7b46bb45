"""The ZeroGPU path on a CPU: with a stand-in `spaces` package importable (as on a ZeroGPU Space),
every UI callback that decodes is wrapped in `spaces.GPU(duration=...)` and the served app still
decodes through the wrappers: the run endpoint, the compare endpoint and Explore's streaming
callback. A fresh process, so the app is imported with the stand-in from the start (the wrapping
happens at import) and no other test sees it."""

import json
import subprocess
import sys
import textwrap

from mtp_viz.serving.backend import BACKEND_OURS
from mtp_viz.ui.controls import setting_fields
from mtp_viz.ui.gpu import GPU_SECONDS

# What `spaces.GPU` does on a Space, minus the GPU: a decorator factory taking `duration`, whose
# wrapper keeps the function's kind (Gradio streams generator functions); each decoration and
# each call is logged to the file SPACES_LOG names.
STAND_IN = """
import functools, inspect, json, os


def _log(event, fn, **extra):
    with open(os.environ["SPACES_LOG"], "a") as f:
        f.write(json.dumps({"event": event, "name": fn.__name__, **extra}) + "\\n")


def GPU(duration=60):
    def decorate(fn):
        _log("decorated", fn, duration=duration)
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                _log("called", fn)
                yield from fn(*args, **kwargs)
        else:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                _log("called", fn)
                return fn(*args, **kwargs)
        return wrapper
    return decorate
"""

# Serve the app and use it as a client would.
CLIENT = textwrap.dedent(
    """
    import json, sys
    from gradio_client import Client
    from mtp_viz.ui.app import build_app

    app = build_app().queue()
    app.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        client = Client(app.local_url, verbose=False)
        run = client.predict("the cat sat", model="tiny", max_new_tokens=4, api_name="/run")
        compared = client.predict("the cat sat", ["prompt_lookup"], model="tiny", max_new_tokens=4, api_name="/compare")
        explored = client.predict(*json.loads(sys.argv[1]), api_name="/explore_stream")
    finally:
        app.close()
    print(json.dumps({
        "run": run["output_token_ids"],
        "compared": [t["strategy"] for t in compared["traces"]],
        "explored": explored[1],
    }))
    """
)
DECODING_CALLBACKS = {"api_run", "api_compare", "explore_run", "compare_run", "distribution"}


def test_every_decoding_callback_runs_inside_spaces_gpu(tmp_path, tiny_registry):
    (tmp_path / "spaces").mkdir()
    (tmp_path / "spaces" / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "spaces.log"
    explore_args = ["the cat", "tiny", "autoregressive", "", 3, 0.0, 0, 1.0, 0, False, "fp32", False, BACKEND_OURS]
    explore_args += [f.default for f in setting_fields().values()]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(tmp_path),
        "SPACES_LOG": str(log),
        "MTP_VIZ_MODELS": str(tiny_registry),
        "MTP_VIZ_CACHE": str(tmp_path / "cache"),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(explore_args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["run"]) == 4
    assert result["compared"] == ["autoregressive", "prompt_lookup"]
    assert "autoregressive · tiny" in result["explored"]  # the summary of the run Explore streamed
    events = [json.loads(line) for line in log.read_text().splitlines()]
    decorated = {e["name"]: e["duration"] for e in events if e["event"] == "decorated"}
    assert decorated == dict.fromkeys(DECODING_CALLBACKS, GPU_SECONDS)
    called = [e["name"] for e in events if e["event"] == "called"]
    assert called.count("api_run") == 1 and called.count("api_compare") == 1 and called.count("explore_run") == 1
