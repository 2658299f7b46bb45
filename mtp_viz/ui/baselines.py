"""The autoregressive run a speedup is measured against: the request that makes it, and the key
by which a run finds the baseline already measured for it (same model, prompt, generation
settings, device and engine)."""

import json
from dataclasses import replace

from mtp_viz.runner import Run, RunRequest
from mtp_viz.trace import Trace

OURS = "mtp-viz"  # the engine of a trace without one named (ours)
_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # generation settings a baseline shares


def as_baseline(request: RunRequest) -> RunRequest:
    """The autoregressive run that a request's speedup is measured against: same model, prompt,
    generation settings, device and compilation."""
    return replace(request, strategy="autoregressive", draft=None, heads=None, strategy_settings={})


def request_baseline_key(request: RunRequest) -> str:
    """`baseline_key` of the trace this request's autoregressive baseline would produce."""
    run = Run(as_baseline(request))
    g = request.generation
    settings = [g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.seed]
    return json.dumps(
        [run.target.name, str(run.target.device), run.prompt_ids, dict(zip(_KEYS, settings, strict=True)), OURS]
    )


def baseline_key(trace: Trace) -> str:
    """Runs with the same model, prompt, generation settings and engine share an autoregressive baseline."""
    g = {k: trace.settings.get(k) for k in _KEYS}
    return json.dumps([trace.model, trace.device, trace.prompt_token_ids, g, trace.machine.get("engine", OURS)])
