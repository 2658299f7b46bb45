"""Forward benchmark (issue 40 §3): what one forward of ours costs and where, eager and compiled,
beside llama.cpp on the same GGUF, in one interleaved run.

    python benchmarks/forward.py [--model smollm2-135m] [--weights q4] [--parts start,forward,ar]
                                 [--no-compiled] [--rounds 15] [--ks 1,2,4,8]
                                 [--prompts 5] [--max-new-tokens 128] [--repeats 3] [--out FILE]

Parts, each printed as a markdown table that names the machine and its threads:
- start (run first, in processes of their own): the compiled engine's start, cold — an empty build
  folder (MTP_VIZ_BUILD_CACHE a new temporary one): our CPU kernels built, the model loaded, the
  layer graph compiled — and warm, a new process on the folder just filled (kernels and compiled
  layer loaded). The rest of the run uses that folder.
- forward: after a fixed context (the first prompt's tokens), interleaved rounds (ours eager, ours
  compiled, llama.cpp) of
  - the one-token forward, timed whole; its products alone (every layer's four projections at one
    row, in the forward's order, on inputs of their shapes: eager, the projections the eager
    forward calls; compiled, our kernels on the static forward's packed weights, each call from
    Python, so its dispatch counts as product); the head alone; the rest = whole − products − head;
  - a forward scoring k new rows (every row's logits), as a strategy's verify runs it, k in --ks;
  - llama.cpp's own k-row evaluations after the same context in its worker, every row's logits,
    each removed from its KV cache again (mtp_viz.llama_worker.verify);
  medians over the rounds (one more, first, warms up untimed).
- ar: autoregressive tokens/s on the prompts, ours eager and compiled (`run`, as engine.py's
  ours_ar and ours_ar_compiled) and llama.cpp's, interleaved, best of --repeats (engine.py's loop).

Weights q4 by default: the shipped GGUF's own Q4_1 codes (head Q8_0), the bits llama.cpp runs.
llama.cpp runs where llama-cpp-python is installed and the model ships a GGUF (one line says why
not elsewhere), with our thread count. Where the compiled engine cannot run here, one line says
why and the eager one is measured alone.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from engine import PROMPTS, agreement, interleaved

from mtp_viz import native, static, static_graph
from mtp_viz.cache import CachedModel
from mtp_viz.clock import Clock
from mtp_viz.lean import CompileUnavailable, LeanModel, lean_model
from mtp_viz.llama_peers import LLAMA_CPP_AUTOREGRESSIVE, LlamaCppPeers, PeerFailed, unavailable
from mtp_viz.loading import encode_prompt, load_model, quiet_transformers
from mtp_viz.machine import describe_peer, machine_info, machine_label
from mtp_viz.paths import BUILD_ENV
from mtp_viz.weights import CHOICES, Q4

PARTS = ("start", "forward", "ar")
EAGER, COMPILED = "eager", "compiled"
LLAMA_CPP = "llama.cpp"
AR_METHOD = {EAGER: "ours_ar", COMPILED: "ours_ar_compiled"}  # engine.py's methods
LLAMA_CPP_AR = "llama_cpp_ar"
START_TIMEOUT_S = 1800.0  # a cold start: build the kernels (~40 s), compile the layer (~1 min), on 2 busy cores


def main() -> int:
    args = parse_args()
    if args.start_child:
        print(json.dumps(start_child(args)))
        return 0
    quiet_transformers()
    threads = torch.get_num_threads()
    llama_why = unavailable(args.model)
    if llama_why:
        print(llama_why, file=sys.stderr)
    record: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    ar_rows: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="mtp-viz-forward-build-") as build, contextlib.ExitStack() as stack:
        if "start" in args.parts and args.compiled:
            record["start"] = measure_start(args, Path(build), threads)
            stack.enter_context(build_folder(build))  # the rest loads what the start just built
        loaded = load_model(args.model, weights=args.weights)
        engines = [EAGER, COMPILED] if args.compiled and compiles(lean_model(loaded.model)) else [EAGER]
        with LlamaCppPeers([] if llama_why else [LLAMA_CPP_AUTOREGRESSIVE], loaded, threads) as llama:
            if "forward" in args.parts:
                record["forward"] = measure_forwards(loaded, engines, args, None if llama_why else llama)
            if "ar" in args.parts:
                methods = [AR_METHOD[e] for e in engines] + ([] if llama_why else [LLAMA_CPP_AR])
                prompts = dict(list(PROMPTS.items())[: args.prompts])
                ar_rows, record["ar"] = interleaved(loaded, prompts, methods, args, llama)
            peer = None if llama_why else llama.machine()
    record["machine"] = machine_info() | ({"peers": {LLAMA_CPP: peer}} if peer else {})
    print_report(record, ar_rows, args, engines, peer)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", choices=CHOICES, default=Q4, help="our engine's weight format (default q4)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our compiled engine beside the eager one (--no-compiled: eager alone, no start part)",
    )
    parser.add_argument("--rounds", type=int, default=15, help="forward: timed rounds (medians)")
    parser.add_argument("--ks", default="1,2,4,8", help="forward: rows a verify scores (1 is always measured)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="ar: the first N of engine.py's prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="ar: runs of each method per prompt (the best counts)")
    parser.add_argument("--out", type=Path, help="write the measurements as JSON")
    parser.add_argument("--start-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)  # the start child's
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    try:
        args.ks = sorted({1, *(int(k) for k in args.ks.split(",") if k.strip())})
    except ValueError:
        parser.error(f"--ks takes integers separated by commas, got {args.ks!r}")
    if args.ks[0] < 1 or args.ks[-1] > static.MAX_ROWS:
        parser.error(f"--ks must lie in 1..{static.MAX_ROWS}")
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    return args


@contextlib.contextmanager
def build_folder(path: str):
    """MTP_VIZ_BUILD_CACHE at `path` for the block (as it was after)."""
    previous = os.environ.get(BUILD_ENV)
    os.environ[BUILD_ENV] = path
    try:
        yield
    finally:
        os.environ.pop(BUILD_ENV) if previous is None else os.environ.__setitem__(BUILD_ENV, previous)


# --- start: the compiled engine from an empty build folder, then from a filled one -----------------


def measure_start(args, build: Path, threads: int) -> dict[str, dict]:
    """Cold (build empty) and warm (build filled by the cold one) starts, each in a new process."""
    return {when: start_process(args, build, threads) for when in ("cold", "warm")}


def start_process(args, build: Path, threads: int) -> dict:
    """One start_child in a process of its own on the build folder `build`; what it measured, the
    process's whole wall time (imports included) beside it, or why it failed."""
    command = [sys.executable, __file__, "--start-child", "--model", args.model, "--weights", args.weights]
    env = os.environ | {BUILD_ENV: str(build)}
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--threads", str(threads)], env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(nothing on stderr)"]
        return {"error": f"exited with status {done.returncode}: {lines[-1][:300]}", "process_s": wall}
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"process_s": wall}


def start_child(args) -> dict:
    """In the start process: the seconds of getting our kernels, loading the model and compiling (or
    loading) its layer graph, each timed apart."""
    quiet_transformers()
    torch.set_num_threads(args.threads or torch.get_num_threads())  # the compiled layer is keyed on threads
    started = time.perf_counter()
    kernels = native.unavailable()
    kernels_s = time.perf_counter() - started
    started = time.perf_counter()
    loaded = load_model(args.model, weights=args.weights)
    load_s = time.perf_counter() - started
    lean = lean_model(loaded.model)
    started = time.perf_counter()
    try:
        if lean is None:
            raise CompileUnavailable("the model runs on transformers' forward, not the lean one")
        lean.compile()
    except CompileUnavailable as e:
        return {"error": f"compiled engine unavailable: {e}", "kernels_s": kernels_s, "load_s": load_s}
    compile_s = time.perf_counter() - started
    return {
        "kernels_s": kernels_s,
        "kernels": kernels or "ours",
        "load_s": load_s,
        "compile_s": compile_s,
        "built": lean.static.built,  # whether the layer was compiled now (cold) or loaded (warm)
        "total_s": kernels_s + load_s + compile_s,
    }


# --- forward: the one-token split and the k-row verify curve --------------------------------------


def compiles(lean: LeanModel | None) -> bool:
    """Whether the compiled engine runs here (compiled now, or loaded); one line why not."""
    try:
        if lean is None:
            raise CompileUnavailable("the model runs on transformers' forward, not the lean one")
        lean.compile()
    except CompileUnavailable as e:
        print(f"compiled engine unavailable, eager alone: {e}", file=sys.stderr)
        return False
    lean.decompile()
    return True


def switch(lean: LeanModel, engine: str) -> None:
    """The model's lean forward eager or compiled (compiled once already: this is a flag)."""
    if engine == COMPILED:
        lean.compile()
    else:
        lean.decompile()


def eager_products(lean: LeanModel, config) -> Callable[[], None]:
    """Every layer's four products at one row as the eager forward calls them: q|k|v, o, gate|up, down."""
    x, attended, mid = inputs(lean, config)

    def products() -> None:
        for block in lean.blocks:
            p = block.proj
            p.qkv(x), p.o(attended), p.gate_up(x), p.down(mid)

    return products


def compiled_products(lean: LeanModel, config) -> Callable[[], None]:
    """The same products on the static forward's packed weights, by our kernels (mtp_viz.static_graph.product)."""
    x, attended, mid = inputs(lean, config)
    fmt = lean.static.config.fmt
    calls = []
    for layer in lean.static.layers:
        n = len(layer.products) // 4  # tensors per projection
        parts = [layer.products[i * n : (i + 1) * n] for i in range(4)]
        calls += list(zip((x, attended, x, mid), parts, strict=True))

    def products() -> None:
        for activations, weights in calls:
            static_graph.product(fmt, activations, weights)

    return products


def inputs(lean: LeanModel, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row each of what the products read: hidden (1, H), attention output (1, heads·d), MLP (1, I)."""
    first = lean.blocks[0]
    sizes = (config.hidden_size, first.heads * first.head_dim, config.intermediate_size)
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, n, generator=g).to(lean.device, lean.dtype) for n in sizes)


class Timer:
    """Our forwards after a fixed context on one cache, as a strategy's target runs them (rows after
    the context attend as one-token forwards do), each rolled back after it is timed."""

    def __init__(self, loaded, context_ids: list[int], new_ids: list[int]):
        self.clock = Clock(loaded.device)
        self.cached = CachedModel(loaded.model, prompt_length=len(context_ids))
        self.context, self.new = context_ids, new_ids
        self.cached.forward(context_ids)

    def verify(self, k: int) -> float:
        """Seconds of a forward scoring k new rows (every row's logits)."""
        start = self.clock.now()
        self.cached.forward(self.context + self.new[:k], logits_to_keep=k)
        elapsed = self.clock.now() - start
        self.cached.rollback(len(self.context))
        return elapsed

    def time(self, call: Callable[[], object]) -> float:
        start = self.clock.now()
        call()
        return self.clock.now() - start


@torch.inference_mode()
def measure_forwards(loaded, engines: list[str], args, llama: LlamaCppPeers | None) -> dict:
    """Seconds by engine, over args.rounds interleaved rounds: "split" (the one-token forward, its
    products, the head) and "verify" (k → a k-row forward), llama.cpp's k-row evaluations beside
    them; the context's length."""
    lean = lean_model(loaded.model)
    context = encode_prompt(loaded, next(iter(PROMPTS.values())))
    if len(context) <= args.ks[-1]:
        raise SystemExit(f"the context ({len(context)} tokens) must be longer than the largest k ({args.ks[-1]})")
    new = context[1 : 1 + args.ks[-1]]  # any tokens: what a forward costs does not depend on them
    timer = Timer(loaded, context, new)
    config = loaded.model.config
    products = {EAGER: eager_products(lean, config)}
    if COMPILED in engines:
        products[COMPILED] = compiled_products(lean, config)
    head_input = inputs(lean, config)[0]
    split = {e: {"forward_s": [], "products_s": [], "head_s": []} for e in engines}
    verify = {e: {k: [] for k in args.ks} for e in [*engines, *([LLAMA_CPP] if llama else [])]}
    for round_ in range(args.rounds + 1):  # round 0 warms every path up, untimed
        for engine in engines:
            switch(lean, engine)
            times = {k: timer.verify(k) for k in args.ks}
            product_s, head_s = timer.time(products[engine]), timer.time(lambda: lean.logits(head_input))
            if engine == COMPILED and not lean.compiled:
                raise SystemExit("the compiled forward failed and fell back to eager (see the warning above)")
            if round_:
                for k, t in times.items():
                    verify[engine][k].append(t)
                for key, t in (("forward_s", times[1]), ("products_s", product_s), ("head_s", head_s)):
                    split[engine][key].append(t)
        if llama is not None and LLAMA_CPP in verify:
            try:
                theirs = llama.verify_times(context, new, args.ks, rounds=1)
            except PeerFailed as e:  # its process died or hung: one line, ours go on
                print(f"{e}; llama.cpp's verify left out from here on", file=sys.stderr)
                del verify[LLAMA_CPP]
                continue
            if round_:
                for k, t in theirs.seconds.items():
                    verify[LLAMA_CPP][k] += t
        print(f"  {time.strftime('%H:%M:%S')} forward round {round_}/{args.rounds} done", file=sys.stderr, flush=True)
    lean.decompile()
    return {"context_tokens": len(context), "split": split, "verify": verify}


# --- tables --------------------------------------------------------------------------------------


def print_report(record: dict, ar_rows: list[tuple], args, engines: list[str], peer: dict | None) -> None:
    where = f"on {machine_label(record['machine'])} (torch {torch.__version__})"
    beside = f", beside {describe_peer(peer)} on {peer['gguf']}" if peer else ""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\n{args.model}, ours on {args.weights} weights, {when}, {where}{beside}")
    if "start" in record:
        print_start(record["start"], where)
    if "forward" in record:
        print_split(record["forward"], where)
        print_verify(record["forward"], where)
    if "ar" in record:
        print_ar(ar_rows, record["ar"], engines, peer is not None, args, where + beside)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def print_start(start: dict[str, dict], where: str) -> None:
    print(f"\n### Compiled engine's start, {where}\n")
    print("| start | our kernels s | load the model s | compile or load the layer s | total s | process s |")
    print("|---|---|---|---|---|---|")
    for when, what in (("cold: an empty build folder", start["cold"]), ("warm: the folder filled", start["warm"])):
        if "error" in what:
            print(f"| {when} | {what['error']} | | | | {what['process_s']:.1f} |")
            continue
        layer = f"{what['compile_s']:.1f} ({'compiled' if what['built'] else 'loaded'})"
        cells = f"{what['kernels_s']:.1f} | {what['load_s']:.1f} | {layer} | {what['total_s']:.1f}"
        print(f"| {when} | {cells} | {what['process_s']:.1f} |")
    print("\n(process: the whole new process, Python's imports included; kernels: built cold, loaded warm)")


def print_split(forward: dict, where: str) -> None:
    print(f"\n### One-token forward, split (medians; {forward['context_tokens']}-token context), {where}\n")
    print("| engine | forward ms | products ms | products | head ms | head | rest ms | rest |")
    print("|---|---|---|---|---|---|---|---|")
    for engine, times in forward["split"].items():
        whole, products, head = (statistics.median(times[k]) for k in ("forward_s", "products_s", "head_s"))
        rest = whole - products - head
        shares = " | ".join(f"{ms(t)} | {t / whole:.0%}" for t in (products, head, rest))
        print(f"| ours {engine} | {ms(whole)} | {shares} |")
    print("\n(products: every layer's 4 projections at one row, timed alone; rest = forward − products − head)")


def print_verify(forward: dict, where: str) -> None:
    ks = sorted(next(iter(forward["verify"].values())))
    print(
        f"\n### k-row verify cost relative to one row (medians; {forward['context_tokens']}-token context), {where}\n"
    )
    print("| engine | 1 row ms | " + " | ".join(f"k = {k}" for k in ks[1:]) + " |")
    print("|---|---|" + "---|" * (len(ks) - 1))
    for engine, times in forward["verify"].items():
        median = {k: statistics.median(v) for k, v in times.items() if v}
        if 1 not in median:
            continue
        cells = " | ".join(f"{median[k] / median[1]:.2f}x ({ms(median[k])} ms)" if k in median else "—" for k in ks[1:])
        print(f"| {engine if engine == LLAMA_CPP else 'ours ' + engine} | {ms(median[1])} | {cells} |")
    print("\n(every row's logits computed; each k-row forward starts at the same context length)")


def print_ar(rows: list[tuple], raw: dict, engines: list[str], llama: bool, args, where: str) -> None:
    print(f"\n### Autoregressive tokens/s, best of {args.repeats}, {args.max_new_tokens} new tokens, {where}\n")
    methods = [AR_METHOD[e] for e in engines] + ([LLAMA_CPP_AR] if llama else [])
    names = [f"ours {e}" for e in engines] + ([LLAMA_CPP] if llama else [])
    ratios = [(1, 0)] if COMPILED in engines else []  # compiled / eager, then each of ours / llama.cpp
    ratios += [(a, len(engines)) for a in range(len(engines))] if llama else []
    columns = ["prompt", "prompt tok", "new tok", *(f"{n} tok/s" for n in names)]
    columns += [f"{names[a]} / {names[b]}" for a, b in ratios]
    columns += ["ours eager = compiled"] if COMPILED in engines else []
    columns += ["llama.cpp tokens = ours"] if llama else []
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    totals = {m: [0, 0.0] for m in methods}  # tokens, seconds at the best rate: the all-prompts row
    for name, n_prompt, n_new, best, identical, same in rows:
        for m in [m for m in methods if m in best]:
            tokens = len(raw[name]["outputs"][m])
            totals[m][0] += tokens
            totals[m][1] += tokens / best[m]
        checks = (["yes" if identical else "NO"] if COMPILED in engines else []) + ([agreement(same)] if llama else [])
        print("| " + " | ".join([name, str(n_prompt), str(n_new), *ar_cells(best, methods, ratios), *checks]) + " |")
    overall = {m: t / s for m, (t, s) in totals.items() if s}
    cells = ["all prompts", "", str(totals[methods[0]][0]), *ar_cells(overall, methods, ratios)]
    print("| " + " | ".join(cells + [""] * (len(columns) - len(cells))) + " |")


def ar_cells(rates: dict[str, float], methods: list[str], ratios: list[tuple[int, int]]) -> list[str]:
    """Tokens/s of each method, then the ratios between them ("—" where one is missing)."""
    cells = [f"{rates[m]:.1f}" if m in rates else "—" for m in methods]
    for a, b in ratios:
        have = methods[a] in rates and methods[b] in rates
        cells.append(f"{rates[methods[a]] / rates[methods[b]]:.2f}x" if have else "—")
    return cells


if __name__ == "__main__":
    sys.exit(main())
