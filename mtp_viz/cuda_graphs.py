"""The lean forward's layer loop compiled for a GPU: torch.compile with CUDA graphs
("reduce-overhead"), attending over the cache's whole capacity under a mask so one graph serves
every step (as gpt-fast's generate.py). A CPU runs mtp_viz.static instead."""

import logging
import time
from collections.abc import Callable

import torch

from mtp_viz.static import CompileUnavailable
from mtp_viz.visibility import causal

log = logging.getLogger(__name__)


def compile_loop(lean) -> Callable:
    """`lean.loop` under torch.compile with CUDA graphs (traced on first use)."""
    log.warning("compiling the forward of %s once for this process (%s)", lean.name, lean.device)
    return torch.compile(lean.loop, mode="reduce-overhead", dynamic=True)


def warm_up(lean) -> float:
    """Run both shape families (one token; several) once on a scratch cache, so the graphs are
    captured outside any timing; returns the seconds it took. CompileUnavailable (and the lean
    model back on eager) when the compiled forward cannot run here."""
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            scratch = lean.new_cache()
            for n in (1, 2, 3):  # 1 is its own graph; 2 and 3 make the row count symbolic
                ids = torch.zeros(n, dtype=torch.long, device=lean.device)
                lean.run(lean.embed(ids), list(range(n)), scratch, 0, None if n == 1 else causal(n))
        torch.cuda.synchronize(lean.device)
        if not lean.compiled:  # `run` fell back to eager and logged why
            raise RuntimeError("the compiled forward failed in its warm-up")
    except Exception as e:  # an op it cannot trace, a missing toolchain piece, an old torch: said, not hidden
        lean.graph, lean.compiled = None, False
        raise CompileUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return time.perf_counter() - start
