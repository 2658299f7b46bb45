"""The ZeroGPU path on a CPU: with a stand-in `spaces` package importable (as on a ZeroGPU Space),
every UI callback that runs a model must run it inside a function wrapped in
`spaces.GPU(duration=...)`, and the served app still decodes through the wrappers. Which callbacks
run a model is not listed here: every event handler of the built app is driven with its inputs'
default values while the model loader (the one way to a model, so to a forward) records whether a
GPU is held when it is asked. A fresh process, so the app is imported with the stand-in from the
start (the wrapping happens at import and build) and no other test sees it."""

import json
import subprocess
import sys
import textwrap

import pytest
from app_registry import registry_with_shipped_model

from mtp_viz.serving.backend import BACKEND_OURS
from mtp_viz.ui.controls import setting_fields
from mtp_viz.ui.gpu import GPU_SECONDS

# What `spaces.GPU` does on a Space, minus the GPU: a decorator factory taking `duration`, whose
# wrapper keeps the function's kind (Gradio streams generator functions) and holds "the GPU" for
# the call (held() says so); each decoration and each call is logged to the file SPACES_LOG names.
STAND_IN = """
import functools, inspect, json, os

_holding = [0]


def held():
    return _holding[0] > 0


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
                _holding[0] += 1
                try:
                    yield from fn(*args, **kwargs)
                finally:
                    _holding[0] -= 1
        else:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                _log("called", fn)
                _holding[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    _holding[0] -= 1
        return wrapper
    return decorate
"""

# Serve the app and use it as a client would; then drive every event handler with the model
# loader replaced by a probe: it records whether the GPU is held and stops the handler there.
SCRIPT = textwrap.dedent(
    """
    import inspect, json, os, sys
    import spaces
    from gradio_client import Client
    from mtp_viz.loading import pipeline
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


    class Reached(BaseException):  # not an Exception: no handler's own error handling catches it
        pass


    held, current = {}, [None]

    def probe(spec):
        held[current[0]] = held.get(current[0], True) and spaces.held()
        raise Reached

    pipeline.load = probe
    os.environ["SPACES_LOG"] += ".walk"  # the calls served above, kept apart from the walk's
    SAMPLES = {"string": "the cat sat", "array": ["prompt_lookup"]}  # for API parameters without a default

    def value(component):
        if component.value is None and hasattr(component, "_api_info"):
            return SAMPLES.get(component._api_info.get("type"))
        return component.value

    driven = []
    for handler in app.fns.values():
        if handler.fn is None:  # a browser-side event (Stop)
            continue
        current[0] = handler.name
        driven.append(handler.name)
        try:
            out = handler.fn(*[value(c) for c in handler.inputs])
            for _ in out if inspect.isgenerator(out) else ():
                pass
        except Reached:
            pass
        except Exception:
            pass  # refused these inputs before asking for a model
    print(json.dumps({
        "run": run["output_token_ids"],
        "compared": [t["strategy"] for t in compared["traces"]],
        "explored": explored[1],
        "driven": driven,
        "held": held,
    }))
    """
)


@pytest.fixture(scope="module")
def through_spaces(tmp_path_factory, tiny_registry):
    """The script's result and the stand-in's log: (result, [log events])."""
    root = tmp_path_factory.mktemp("zerogpu")
    (root / "spaces").mkdir()
    (root / "spaces" / "__init__.py").write_text(STAND_IN)
    log = root / "spaces.log"
    explore_args = ["the cat", "tiny", "autoregressive", "", 3, 0.0, 0, 1.0, 0, False, "fp32", False, BACKEND_OURS]
    explore_args += [f.default for f in setting_fields().values()]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
        "PYTHONPATH": str(root),
        "SPACES_LOG": str(log),
        "MTP_VIZ_MODELS": str(registry_with_shipped_model(tiny_registry, root)),  # Deploy? prices shipped results
        "MTP_VIZ_CACHE": str(root / "cache"),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(explore_args)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, [json.loads(line) for line in log.read_text().splitlines()]


def test_the_served_app_decodes_through_the_gpu_wrappers(through_spaces):
    result, events = through_spaces
    assert len(result["run"]) == 4
    assert result["compared"] == ["autoregressive", "prompt_lookup"]
    assert "autoregressive · tiny" in result["explored"]  # the summary of the run Explore streamed
    decorated = {e["name"]: e["duration"] for e in events if e["event"] == "decorated"}
    assert set(decorated.values()) == {GPU_SECONDS}
    called = [e["name"] for e in events if e["event"] == "called"]
    assert called.count("api_run") == 1 and called.count("api_compare") == 1 and called.count("explore_run") == 1


def test_every_callback_that_runs_a_model_holds_the_gpu(through_spaces):
    """Each handler that asks the loader for a model (so runs one: a page load's hidden pricing, a
    measurement, a decode) asks while the GPU is held."""
    result, _ = through_spaces
    held = result["held"]
    assert {"explore_run", "api_run"} <= set(held) <= set(result["driven"])  # the probe saw the app's runs
    outside = sorted(name for name, inside in held.items() if not inside)
    assert not outside, f"these callbacks load or run a model outside spaces.GPU: {outside}"
