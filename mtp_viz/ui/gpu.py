"""ZeroGPU support: on a Hugging Face ZeroGPU Space (the `spaces` package is installed), GPU work
must run inside a function decorated with `spaces.GPU`, which holds a GPU for that call. Elsewhere
the decorator is a no-op. Each UI callback that decodes is decorated whole, so all strategies of
one comparison run in one allocation and their timings compare."""

import importlib.util

GPU_SECONDS = 120  # the longest one callback may hold a ZeroGPU device


def on_gpu(fn):
    if importlib.util.find_spec("spaces") is None:
        return fn
    import spaces  # optional: installed on a ZeroGPU Space only, so imported where it is known to exist

    return spaces.GPU(duration=GPU_SECONDS)(fn)
