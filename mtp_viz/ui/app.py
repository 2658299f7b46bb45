"""The mtp-viz Gradio app: tabs composed with .render(), plus named API endpoints.

Nothing heavy happens at import or build time, nor on page load: models load on the first run
that needs them, and a tab other than Explore draws when a user first opens it (mtp_viz.ui.opening).
"""

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.loading import model_name
from mtp_viz.registry import load_registry
from mtp_viz.serving import pool
from mtp_viz.ui import comparison
from mtp_viz.ui.bench_tab import build_bench
from mtp_viz.ui.compare import build_compare
from mtp_viz.ui.deploy_tab import build_deploy
from mtp_viz.ui.explore import build_explore
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.ui.opening import on_first_open
from mtp_viz.ui.requests import build_request, parse_settings
from mtp_viz.ui.streaming import run_to_end
from mtp_viz.ui.theory_tab import build_theory

TITLE = "mtp-viz"
INTRO = (
    "# mtp-viz\nSee where speculative decoding and multi-token prediction gain or lose time, token "
    "by token. Everything below is drawn from one trace format; download a trace and open it elsewhere."
)


@on_gpu
def api_run(
    prompt: str,
    model: str = "",
    strategy: str = "autoregressive",
    draft: str = "",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    raw: bool = False,
    num_draft_tokens: int | None = None,
    max_ngram_size: int | None = None,
    min_ngram_size: int | None = None,
    settings: dict | None = None,
    compile: str = "auto",
    weights: str = "auto",
) -> dict:
    """Decode one prompt with one strategy; returns the trace as JSON (docs/trace-format.md).
    `settings`: any of the strategy's settings by name (README), e.g. {"tree": "chain", "tau": 0.8}.
    `compile`: auto (on a GPU; on a CPU where it measured faster) | on | off, the compiled lean
    forward (the trace's `machine` says what happened). `weights`: auto | fp32 | bf16 | int8 | q4,
    the models' weight format (the trace's `machine` says which ran, and for auto why)."""
    named = {"num_draft_tokens": num_draft_tokens, "max_ngram_size": max_ngram_size, "min_ngram_size": min_ngram_size}
    named = {k: v for k, v in named.items() if v is not None}  # given on purpose: the strategy must have them
    generation = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        settings = {**named, **parse_settings(settings)}
        request = build_request(prompt, model, strategy, draft, raw, settings, compile, weights, **generation)
        return run_to_end(request).to_dict()
    except UserError as e:
        raise gr.Error(str(e)) from None


@on_gpu
def api_compare(
    prompt: str,
    strategies: list[str],
    model: str = "",
    draft: str = "",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    num_draft_tokens: int | None = None,
) -> dict:
    """Autoregressive plus the given strategies on one prompt; returns traces, metrics and verdicts."""
    request = dict(prompt=prompt, model=model, draft=draft, num_draft_tokens=num_draft_tokens)
    generation = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    try:
        *_, (_, _, result) = comparison.compare(strategies, **request, **generation)
    except UserError as e:
        raise gr.Error(str(e)) from None
    return {
        "traces": [t.to_dict() for t in result.traces],
        "metrics": result.metrics.to_dict(orient="records"),
        "verdicts": result.verdicts,
    }


def build_app() -> gr.Blocks:
    pool.stop_on_exit()  # the vLLM servers Explore keeps between runs go when we are told to terminate
    registry = load_registry()
    default_model = model_name(None)
    explore = build_explore(registry, default_model)
    compare = build_compare(registry, default_model)
    theory, theory_opened = build_theory()
    bench, bench_opened = build_bench()
    deploy, deploy_opened = build_deploy()
    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(INTRO)
        with gr.Tab("Explore"):
            explore.render()
        with gr.Tab("Compare"):
            compare.render()
        with gr.Tab("Theory") as theory_tab:
            theory.render()
        with gr.Tab("Benchmark") as bench_tab:
            bench.render()
        with gr.Tab("Deploy?") as deploy_tab:
            deploy.render()
        on_first_open(theory_tab, theory_opened)
        on_first_open(bench_tab, bench_opened)
        on_first_open(deploy_tab, deploy_opened)
        gr.api(api_run, api_name="run", concurrency_limit=4)
        gr.api(api_compare, api_name="compare", concurrency_limit=2)
    return app
