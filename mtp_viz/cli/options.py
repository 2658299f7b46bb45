"""Options more than one command takes, and reading the options a user gave."""

import argparse

from mtp_viz.runner import COMPILE_CHOICES
from mtp_viz.serving.backend import BACKEND_OURS, BACKENDS
from mtp_viz.weights import AUTO, CHOICES

COMPILE_HELP = (
    "the compiled lean forward: auto (on a GPU; on a CPU where it measured faster, built here once), on, off; "
    "outside the timing"
)


def add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="auto", help=COMPILE_HELP)


def add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--weights",
        choices=CHOICES,
        default=AUTO,
        help="weight format of every model of the run: fp32, bf16, int8 (per channel), q4 (a GGUF's own 4-bit "
        "codes where the model ships as one); auto: the fastest here whose greedy agreement with fp32 is ≥ 99%% "
        "(measured once per machine and model, cached)",
    )


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=BACKEND_OURS,
        help="mtp-viz (our instrumented engine) or vllm (a vLLM server started in .venv-vllm, or --vllm-url)",
    )
    p.add_argument("--vllm-url", help="use the vLLM server already running at this URL instead of starting one")


def given(args: argparse.Namespace, *names: str, **renamed: str) -> dict:
    """The options the user gave (not None) as keywords: `names` under their own name, `renamed`
    as keyword=option (e.g. reduced_vocab="vocab")."""
    chosen = {**{n: n for n in names}, **renamed}
    return {key: getattr(args, option) for key, option in chosen.items() if getattr(args, option) is not None}
