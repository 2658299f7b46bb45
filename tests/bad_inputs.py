"""One corpus of bad and odd inputs, run through both the CLI (test_cli.py) and the Gradio API
(test_app.py) against the tiny registry. Each case is a request (the API's parameter names) and
what must come back: a substring of the one-line message, or None where the input is odd but
valid and must decode normally (control characters, emoji, right-to-left text, markup)."""

from dataclasses import dataclass, field

from mtp_viz.runner import MAX_PROMPT_CHARS


@dataclass(frozen=True)
class Case:
    request: dict
    expect: str | None  # a substring of the message; None: runs and returns a trace
    settings: dict = field(default_factory=dict)  # strategy settings by name


CASES = {
    "empty prompt": Case({"prompt": ""}, "empty"),
    "whitespace prompt": Case({"prompt": "  \n\t "}, "empty"),
    "100,000-character prompt": Case({"prompt": "a" * 100_000}, f"limit is {MAX_PROMPT_CHARS}"),
    "max new tokens 0": Case({"max_new_tokens": 0}, "max_new_tokens"),
    "max new tokens -1": Case({"max_new_tokens": -1}, "max_new_tokens"),
    "max new tokens 10^9": Case({"max_new_tokens": 10**9}, "max_new_tokens"),
    "negative temperature": Case({"temperature": -1.0}, "temperature"),
    "NaN temperature": Case({"temperature": float("nan")}, "temperature"),
    "huge temperature": Case({"temperature": 1e9}, "temperature"),
    "top-p 0": Case({"top_p": 0.0}, "top_p"),
    "top-p 1.5": Case({"top_p": 1.5}, "top_p"),
    "NaN top-p": Case({"top_p": float("nan")}, "top_p"),
    "negative top-k": Case({"top_k": -3}, "top_k"),
    "negative seed": Case({"seed": -1}, "seed"),
    "draft length 0": Case({"strategy": "speculative", "num_draft_tokens": 0}, "num_draft_tokens"),
    "draft length 1000": Case({"strategy": "prompt_lookup", "num_draft_tokens": 1000}, "num_draft_tokens"),
    "unknown model": Case({"model": "gpt-9"}, "unknown model"),
    "a file path as model": Case({"model": "/etc/passwd"}, "registry"),
    "unknown strategy": Case({"strategy": "telepathy"}, "unknown strategy"),
    "draft with another vocabulary": Case({"strategy": "speculative", "draft": "tiny-other"}, "different vocabulary"),
    "unknown draft": Case({"strategy": "speculative", "draft": "nope"}, "unknown"),
    "setting of another strategy": Case({"num_draft_tokens": 3}, "no setting"),
    "unknown setting": Case({"strategy": "lookahead"}, "no setting", {"speed": 11}),
    "setting of the wrong type": Case({"strategy": "lookahead"}, "window", {"window": "wide"}),
    "lookahead window 0": Case({"strategy": "lookahead"}, "window", {"window": 0}),
    "malformed tree": Case({"strategy": "mtp_heads"}, "tree", {"tree": "0,x"}),
    "no heads registered": Case({"strategy": "mtp_heads"}, "no MTP heads"),
    "no EAGLE-3 drafter registered": Case({"strategy": "eagle"}, "no EAGLE-3 drafter registered for tiny"),
    "tau above one": Case({"strategy": "conf_adapt"}, "tau", {"tau": 1.5}),
    "k too large": Case({"strategy": "conf_adapt"}, "k must", {"k": 99}),
    "mask tokens on a model without one": Case({"strategy": "conf_adapt"}, "mask token", {"predictor": "mask_tokens"}),
    "unknown schedule": Case({"strategy": "speculative"}, "schedule", {"schedule": "fast"}),
    "exit layer past the model": Case({"strategy": "self_speculative"}, "exit_layer", {"exit_layer": 2}),
    # odd but valid: these decode
    "control characters": Case({"prompt": "a\x00b\x07c\x1b[31m red \r\n\x7f"}, None),
    "emoji": Case({"prompt": "🦜🔥 why is 👩‍👩‍👧 one glyph?"}, None),
    "right-to-left text": Case({"prompt": "مرحبا بالعالم \u202eevil\u202c שלום"}, None),
    "lone surrogate": Case({"prompt": "half a pair \ud800 here"}, None),
    "HTML and script": Case({"prompt": "<script>alert(1)</script><img src=x onerror=alert(1)> &amp;"}, None),
}


def request(case: Case) -> dict:
    """The API's keyword arguments: the tiny model, a short run, the case's fields."""
    out = {"prompt": "the cat sat", "model": "tiny", "max_new_tokens": 4, **case.request}
    if case.settings:
        out["settings"] = case.settings
    return out


FLAGS = {
    "model": "--model",
    "strategy": "--strategy",
    "draft": "--draft",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "num_draft_tokens": "--num-draft-tokens",
}


def argv(case: Case) -> list[str]:
    """The same request as `python -m mtp_viz run` arguments."""
    req = request(case)
    out = ["run", "--prompt", req.pop("prompt")]
    for name, value in case.settings.items():
        out += ["--set", f"{name}={value}"]
    req.pop("settings", None)
    for name, value in req.items():
        out += [FLAGS[name], str(value)]
    return out
