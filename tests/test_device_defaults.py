"""Settings whose default depends on the device: declared once, used by runs and shown in the README."""

import re
from pathlib import Path

import pytest

from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.strategies.settings import device_defaults, for_device

README = Path(__file__).resolve().parents[1] / "README.md"


def test_cpu_and_gpu_defaults_differ_where_declared():
    spec = STRATEGIES["speculative"].settings_cls
    assert device_defaults(spec, "cpu")["num_draft_tokens"] == 1
    assert device_defaults(spec, "cuda")["num_draft_tokens"] == 5
    assert device_defaults(STRATEGIES["mask_spec"].settings_cls, "cuda")["k"] == 4
    assert for_device(spec, "cuda", {"num_draft_tokens": 2}).num_draft_tokens == 2  # a value given wins


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
def test_every_strategy_builds_with_its_device_defaults(device):
    for spec in STRATEGIES.values():
        for_device(spec.settings_cls, device, {})  # validation runs on the GPU values too


def test_a_run_on_the_cpu_takes_the_cpu_default(use_tiny_registry):
    trace = run(
        RunRequest(
            prompt="the cat sat", model="tiny", strategy="speculative", generation=GenerationSettings(max_new_tokens=4)
        )
    )
    assert trace.settings["num_draft_tokens"] == 1
    assert max(len(s.drafted) for s in trace.steps) <= 1


def test_the_readme_table_shows_both_defaults():
    lines = README.read_text(encoding="utf-8").splitlines()
    for name, spec in STRATEGIES.items():
        cpu, gpu = device_defaults(spec.settings_cls, "cpu"), device_defaults(spec.settings_cls, "cuda")
        for field in (f for f in cpu if cpu[f] != gpu[f]):
            shown = rf"`{field}` \(`?{re.escape(str(cpu[field]))}`? / `?{re.escape(str(gpu[field]))}`?"
            assert any(line.startswith(f"| `{name}` |") and re.search(shown, line) for line in lines), (name, field)
