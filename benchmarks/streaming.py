"""Does streaming to the browser slow decoding? The same greedy request, end to end, through the
runner (what the CLI does) and through the launched app's streaming Explore endpoint, interleaved.

    .venv/bin/python benchmarks/streaming.py [--max-new-tokens 96] [--repeats 3]

Reports the elapsed time from request to final trace on both paths (what a user waits for), and
the decoding tokens/s recorded in each trace.
"""

import argparse
import time

from gradio_client import Client

from mtp_viz.models import quiet_transformers
from mtp_viz.prompts import CODE_EDIT_PROMPT
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import Trace
from mtp_viz.ui.app import build_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", default="prompt_lookup")
    args = parser.parse_args()
    quiet_transformers()
    app = build_app().queue()
    app.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    client = Client(app.local_url, verbose=False)
    request = RunRequest(
        prompt=CODE_EDIT_PROMPT,
        strategy=args.strategy,
        generation=GenerationSettings(max_new_tokens=args.max_new_tokens),
    )
    ui_args = [CODE_EDIT_PROMPT, "smollm2-135m", args.strategy, "", 5, 3, 2, args.max_new_tokens, 0.0, 0, 1.0, 0, False]
    run(request)  # warm-up: loads and converts the model once
    cli, ui, cli_tps, ui_tps, updates = [], [], [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        trace = run(request)
        cli.append(time.perf_counter() - start)
        cli_tps.append(trace.summary["tokens_per_s"])
        start = time.perf_counter()
        job = client.submit(*ui_args, api_name="/explore_stream")
        n = sum(1 for _ in job)
        ui.append(time.perf_counter() - start)
        updates.append(n)
        final = job.outputs()[-1]
        path = next(x for x in final if isinstance(x, str) and x.endswith(".json"))  # the trace download
        ui_tps.append(Trace.load(path).summary["tokens_per_s"])
    app.close()
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


if __name__ == "__main__":
    main()
