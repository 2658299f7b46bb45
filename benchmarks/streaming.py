"""Does streaming to the browser slow decoding? The same greedy request, end to end, through the
runner (what the CLI does) and through the launched app's streaming Explore endpoint, interleaved.

    .venv/bin/python benchmarks/streaming.py [--max-new-tokens 96] [--repeats 3] [--model smollm2-135m]

Reports the elapsed time from request to final trace on both paths (what a user waits for), and
the decoding tokens/s recorded in each trace. Its figures are in docs/BENCHMARKS.md, "Streaming
through the app vs the runner (issue 3)"; log in docs/results/streaming-bench.log.
"""

import argparse
import time
from dataclasses import fields

from served import cpu_seconds, served_app

from mtp_viz.loading import quiet_transformers
from mtp_viz.prompts import CODE_EDIT_PROMPT
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace
from mtp_viz.ui.controls import setting_fields
from mtp_viz.ui.explore import render as render_views
from mtp_viz.ui.jobs import STREAM_INTERVAL_S
from mtp_viz.viz.tokens import tokens_html


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", default="prompt_lookup")
    parser.add_argument("--model", default="smollm2-135m", help="registry id, as the app's model menu lists it")
    parser.add_argument("--port", type=int, default=7861)
    args = parser.parse_args()
    quiet_transformers()
    # The app runs in its own process, as it does for a user; this process is the browser's stand-in.
    with served_app(args.port) as (server, _, client):
        trace, cli, ui, cli_tps, ui_tps, updates, cli_cpu, ui_cpu = _measure(args, server, client)
    start = time.perf_counter()
    for _ in range(20):
        tokens_html(trace.steps)
    render = (time.perf_counter() - start) / 20
    start = time.process_time()
    for _ in range(5):
        render_views(trace, {})
    final = (time.process_time() - start) / 5
    _report(args, trace, cli, ui, cli_tps, ui_tps, updates, cli_cpu, ui_cpu, render)
    print(f"  the final render of every Explore view takes {final * 1e3:.0f} ms of CPU per run")


def _measure(args, server, client):
    request = RunRequest(
        prompt=CODE_EDIT_PROMPT,
        model=args.model,
        strategy=args.strategy,
        generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
    )
    # the Explore inputs: prompt, model, strategy, draft, max new, temperature, top-k, top-p, seed,
    # raw, the weights (the CLI run's), measure-autoregressive-too (off: only the strategy runs), the engine,
    # then every strategy setting's control (left at its default)
    own = {f.name: f.default for f in fields(STRATEGIES[args.strategy].settings_cls)}
    ui_args = [CODE_EDIT_PROMPT, args.model, args.strategy, "", args.max_new_tokens, 0.0, 0, 1.0, 0, False]
    ui_args += [request.weights, False]
    ui_args += ["mtp-viz"]  # the engine
    ui_args += [own.get(name, f.default) for name, f in setting_fields().items()]
    run(request)  # warm-up: loads and converts the model once
    cli, ui, cli_tps, ui_tps, updates, cli_cpu, ui_cpu = [], [], [], [], [], [], []
    for _ in range(args.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        trace = run(request)
        cli.append(time.perf_counter() - start)
        cli_cpu.append(time.process_time() - cpu)
        cli_tps.append(trace.summary["tokens_per_s"])
        start, cpu = time.perf_counter(), cpu_seconds(server.pid)
        job = client.submit(*ui_args, api_name="/explore_stream")
        n = sum(1 for _ in job)
        ui.append(time.perf_counter() - start)
        ui_cpu.append(cpu_seconds(server.pid) - cpu)
        updates.append(n)
        final = job.outputs()[-1]
        path = next(x for x in final if isinstance(x, str) and x.endswith(".json"))  # the trace download
        ui_tps.append(Trace.load(path).summary["tokens_per_s"])
    return trace, cli, ui, cli_tps, ui_tps, updates, cli_cpu, ui_cpu


def _report(args, trace, cli, ui, cli_tps, ui_tps, updates, cli_cpu, ui_cpu, render):
    best_cli, best_ui = min(cli), min(ui)
    print(f"{args.strategy}, {args.max_new_tokens} new tokens, best of {args.repeats} interleaved runs")
    print(
        f"  end to end: runner {best_cli:.2f} s, streamed through the app {best_ui:.2f} s "
        f"({len(updates) and max(updates)} updates) -> streaming costs {best_ui / best_cli - 1:+.1%}"
    )
    print(
        f"  decoding tokens/s in the traces: runner {max(cli_tps):.1f}, app {max(ui_tps):.1f} "
        f"({max(ui_tps) / max(cli_tps) - 1:+.1%})"
    )
    print(
        f"  CPU seconds per run (all threads): runner {min(cli_cpu):.2f}, app {min(ui_cpu):.2f} "
        f"({min(ui_cpu) / min(cli_cpu) - 1:+.1%}): the extra work streaming does"
    )
    print(
        f"  one token-view update of {len(trace.steps)} steps renders in {render * 1e3:.2f} ms; at "
        f"{1 / STREAM_INTERVAL_S:.0f} updates/s that is {render / STREAM_INTERVAL_S:.2%} of a core"
    )


if __name__ == "__main__":
    main()
