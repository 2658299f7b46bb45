"""Every script in benchmarks/ runs, on tiny random models at the smallest settings, and prints
its table: a smoke test, so a change elsewhere cannot leave a user's benchmark broken unseen. The
figures themselves mean nothing here. The two that drive the app share one launched app."""

import contextlib
import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_dir

from mtp_viz.__main__ import main as cli

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MODEL, DRAFT = "smoke", "smoke-draft"  # ids of their own, so no other test shares these loaded models


@pytest.fixture(scope="module")
def smoke_env(tmp_path_factory):
    """A registry of a tiny target and draft; the fixed linear plan (nothing measured); a fresh cache."""
    root = tmp_path_factory.mktemp("bench-models")
    save_tiny_dir(root / "target")
    save_tiny_dir(root / "draft", noise=0.2)
    registry = {
        "defaults": {"cpu": MODEL, "cuda": MODEL},
        "models": [
            {"id": MODEL, "label": "Smoke", "chat": True, "sources": [{"kind": "local", "path": "target"}]},
            {"id": DRAFT, "label": "Smoke draft", "sources": [{"kind": "local", "path": "draft"}]},
        ],
    }
    registry["models"][0]["drafts"] = [DRAFT]
    (root / "models.yaml").write_text(json.dumps(registry))  # JSON is YAML
    env = {"MTP_VIZ_MODELS": str(root / "models.yaml"), "MTP_VIZ_LINEAR": "fast", "MTP_VIZ_CACHE": str(root / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.syspath_prepend(str(BENCHMARKS))  # the scripts import their sibling `served`
        yield root


def script(name: str):
    """A benchmark script as a module (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(module, monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


def test_engine(smoke_env, monkeypatch, capsys, tmp_path):
    engine = script("engine")
    methods = [m for m in engine.METHODS if m not in ("ours_ar_compiled", "hf_static_compile")]  # compiling: minutes
    out = tmp_path / "engine.json"
    args = ["--model", MODEL, "--prompts", "1", "--repeats", "1", "--max-new-tokens", "4"]
    assert run_script(engine, monkeypatch, *args, "--methods", ",".join(methods), "--out", str(out)) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| code-edit |"))
    assert row.endswith("| yes |")  # every method wrote the same greedy tokens
    assert row.count("—") == 3  # the compiled columns, left out
    record = json.loads(out.read_text())
    assert set(record["results"]["code-edit"]["tokens_per_s"]) == set(methods)
    assert "tracing cost measured directly" in printed
    assert run_script(engine, monkeypatch, "--model", MODEL, "--prompts", "1", "--direct-only") == 0
    assert "n-gram lookup with no match, code-edit" in capsys.readouterr().out


def test_cpu_linear(smoke_env, monkeypatch, capsys):
    run_script(script("cpu_linear"), monkeypatch, "--model", MODEL, "--draft", DRAFT, "--repeats", "1", "--tokens", "4")
    printed = capsys.readouterr().out
    assert "| output head | 64 |" in printed and "| fast |" in printed
    assert "same tokens: True" in printed  # the linear path does not change what decoding writes


def test_time_split(smoke_env, monkeypatch, capsys, tmp_path):
    out = tmp_path / "bench"
    bench = ["bench", "--model", MODEL, "--categories", "translation", "--limit", "1"]
    assert cli([*bench, "--strategies", "prompt_lookup", "--max-new-tokens", "4", "--out", str(out)]) == 0
    capsys.readouterr()
    run_script(script("time_split"), monkeypatch, str(out))
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"autoregressive", "prompt_lookup"}
    assert all(len(cells) == 4 and int(cells[0]) > 0 for cells in rows.values())  # steps, then three times


@pytest.fixture(scope="module")
def launched_app(smoke_env):
    """app.py in its own process, as `served.served_app` starts it for load.py and streaming.py."""
    from served import served_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with served_app(port) as running:
        yield running


def test_load(launched_app, monkeypatch, capsys):
    load = script("load")
    monkeypatch.setattr(load, "served_app", lambda port: contextlib.nullcontext(launched_app))
    args = ["--users", "2", "--requests", "1", "--repeated", "1", "--max-new-tokens", "4"]
    run_script(load, monkeypatch, *args, "--strategies", "autoregressive,speculative")
    printed = capsys.readouterr().out
    assert "2 ok, 0 errors, 0 results differ from the same request alone" in printed


def test_streaming(launched_app, monkeypatch, capsys):
    streaming = script("streaming")
    monkeypatch.setattr(streaming, "served_app", lambda port: contextlib.nullcontext(launched_app))
    run_script(streaming, monkeypatch, "--model", MODEL, "--max-new-tokens", "4", "--repeats", "1")
    printed = capsys.readouterr().out
    assert "end to end: runner" in printed and "CPU seconds per run" in printed


def test_weights(smoke_env, monkeypatch, capsys, tmp_path):
    out = tmp_path / "weights.json"
    args = ["--model", MODEL, "--prompts", "2", "--new-tokens", "4", "--ar-prompts", "1", "--max-new-tokens", "3"]
    assert (
        run_script(script("weights"), monkeypatch, *args, "--rounds", "1", "--bandwidth-gib", "0.01", "--out", str(out))
        == 0
    )
    printed = capsys.readouterr().out
    assert "| q4 |" in printed and "| fp32 | 100.00% |" in printed and "read bandwidth" in printed
    assert set(json.loads(out.read_text())["formats"]) == {"fp32", "bf16", "int8", "q4"}
