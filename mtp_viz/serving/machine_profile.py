"""This machine's engine profile for `bench --backend vllm --schedule auto` without `--profile`:
measured once (`profile --backend vllm` with the sweep's prompts, as served) and kept under the
cache, keyed by everything it depends on (profile_path); a later sweep with the same key reads it
back in a moment."""

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mtp_viz.loading.spec import resolve_device
from mtp_viz.machine import machine_info, machine_label
from mtp_viz.measured import write_atomically
from mtp_viz.paths import cache_root
from mtp_viz.profile import ProfileView, read_profile
from mtp_viz.runner import RunRequest
from mtp_viz.serving.engine_profile import DRAFTERS, engine_profile
from mtp_viz.serving.server import ServerError, vllm_python

FOLDER = "profiles"
VERSION = 2  # of what a kept profile holds: one made before is measured again


def drafters_of(requests: list[RunRequest]) -> dict[str, RunRequest]:
    """The first request of each drafting strategy among a sweep's: whose drafter cost is measured."""
    found: dict[str, RunRequest] = {}
    for r in requests:
        if r.strategy in DRAFTERS and r.strategy not in found:
            found[r.strategy] = replace(r, strategy_settings={})
    return found


def profile_path(
    base: RunRequest, drafters: dict[str, RunRequest], prompts: list[str], sizes: tuple[int, ...], new_tokens: int
) -> Path:
    """Where this machine's profile for these settings is kept: keyed by the machine (its CPU and
    any accelerator the run uses), the target as loaded (model, device, dtype, weights), the vLLM
    install, the drafters, the prompts, the levels, the tokens a request decodes and this format's
    version, so a changed one of them is measured afresh."""
    key = {
        "version": VERSION,
        "machine": machine_label(machine_info(resolve_device(base.device))),
        "model": [base.model, base.device, base.dtype, base.weights],
        "vllm": vllm_install(),
        "drafters": {s: [r.draft, r.eagle3] for s, r in sorted(drafters.items())},
        "prompts": hashlib.sha256("\x00".join(prompts).encode()).hexdigest(),
        "sizes": list(sizes),
        "new_tokens": new_tokens,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / FOLDER / f"vllm-{str(base.model or 'default').replace('/', '--')}-{digest}.json"


def vllm_install() -> str:
    """The vLLM install a profile times: its interpreter and the version its package records."""
    try:
        python = vllm_python()
    except ServerError:
        return "none"
    found = sorted(python.parent.parent.glob("lib/python*/site-packages/vllm-*.dist-info"))
    return f"{python}:{found[-1].name if found else 'unknown'}"


def machine_profile(
    base: RunRequest,
    drafters: dict[str, RunRequest],
    prompts: list[str],
    sizes: tuple[int, ...],
    new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> tuple[ProfileView, Path]:
    """(the profile, where it is kept): read back, or measured now and kept."""
    path = profile_path(base, drafters, prompts, sizes, new_tokens)
    kept = read_profile(path) if path.is_file() else None
    if kept is None or kept.served is None:  # none yet, or one without the costs as served
        if progress:
            progress(f"measuring this machine's vLLM profile once (kept in {path})")
        result = engine_profile(
            base, sizes, drafters=drafters, progress=progress, served_prompts=prompts, new_tokens=new_tokens
        )
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(result.as_dict(), indent=1)), "the profile")
    view = read_profile(path)
    assert view is not None
    return view, path
