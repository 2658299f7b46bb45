"""This machine's engine profile for `bench --backend vllm --schedule auto` without `--profile`:
measured once (`profile --backend vllm` with the sweep's prompts, as served) and kept under the
cache, keyed by the machine, the target, the drafters, the concurrency levels and the tokens a
request decodes; a later sweep with the same key reads it back in a moment."""

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mtp_viz.machine import machine_info, machine_label
from mtp_viz.measured import write_atomically
from mtp_viz.paths import cache_root
from mtp_viz.profile import ProfileView, read_profile
from mtp_viz.runner import RunRequest
from mtp_viz.serving.engine_profile import DRAFTERS, engine_profile

FOLDER = "profiles"


def drafters_of(requests: list[RunRequest]) -> dict[str, RunRequest]:
    """The first request of each drafting strategy among a sweep's: whose drafter cost is measured."""
    found: dict[str, RunRequest] = {}
    for r in requests:
        if r.strategy in DRAFTERS and r.strategy not in found:
            found[r.strategy] = replace(r, strategy_settings={})
    return found


def profile_path(base: RunRequest, drafters: dict[str, RunRequest], sizes: tuple[int, ...], new_tokens: int) -> Path:
    """Where this machine's profile for these settings is kept."""
    key = {
        "machine": machine_label(machine_info("cpu")),
        "model": base.model,
        "drafters": {s: [r.draft, r.eagle3] for s, r in sorted(drafters.items())},
        "sizes": list(sizes),
        "new_tokens": new_tokens,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / FOLDER / f"vllm-{str(base.model or 'default').replace('/', '--')}-{digest}.json"


def machine_profile(
    base: RunRequest,
    drafters: dict[str, RunRequest],
    prompts: list[str],
    sizes: tuple[int, ...],
    new_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> tuple[ProfileView, Path]:
    """(the profile, where it is kept): read back, or measured now and kept."""
    path = profile_path(base, drafters, sizes, new_tokens)
    if not path.is_file():
        if progress:
            progress(f"measuring this machine's vLLM profile once (kept in {path})")
        result = engine_profile(
            base, sizes, drafters=drafters, progress=progress, served_prompts=prompts, new_tokens=new_tokens
        )
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(result.as_dict(), indent=1)), "the profile")
    view = read_profile(path)
    assert view is not None
    return view, path
