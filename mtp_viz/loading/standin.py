"""A stand-in for a model whose weights cannot travel to a lent GPU machine (the device tool carries
64 MiB; the embedded model's GGUF is 98 MB): its own config and tokenizer files, carried, with
seeded random weights of the same shapes, written as the model's converted copy in a cache folder
(`cache` is every registered model's first source). Forward times, verify curves, CUDA graphs and
greedy identity do not depend on the weights; acceptance rates and text do, so a stand-in's are
meaningless, and its folder says what it is (standin.json).

    python -m mtp_viz.loading.standin --carry .device   # here: copy the embedded model's small files
    python -m mtp_viz.loading.standin --from .device/smollm2-135m --cache DIR   # there: build it

Then MTP_VIZ_CACHE=DIR makes `smollm2-135m` load the stand-in (scripts/gpu_check.sh: STANDIN=...).
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mtp_viz.loading.sources import CONVERTED_FROM
from mtp_viz.paths import cache_root

MODEL = "smollm2-135m"
WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")  # left behind: everything else is a few MB
MARKER = "standin.json"


def carry(model_dir: Path, out: Path) -> Path:
    """The model directory's files but its weights (config, tokenizer: a few MB) copied into
    out/<its name>; a converted copy's note of the GGUF it came from is left too (a stand-in is not it)."""
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} holds no config.json: load the model once here first")
    dest = out / model_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHTS) and path.name != CONVERTED_FROM:
            shutil.copy2(path, dest / path.name)
    return dest


def build(small: Path, cache: Path, seed: int = 0) -> Path:
    """The stand-in in cache/<its name>: the carried files and seeded random weights (float32)."""
    dest = cache / small.name
    dest.mkdir(parents=True, exist_ok=True)
    for path in small.iterdir():
        if path.is_file():
            shutil.copy2(path, dest / path.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dest), dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    (dest / MARKER).write_text(json.dumps({"random_weights": True, "seed": seed, "shapes_of": small.name}))
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--carry", type=Path, help="copy the embedded model's small files into this folder")
    parser.add_argument("--from", dest="small", type=Path, help="a carried folder (config and tokenizer)")
    parser.add_argument("--cache", type=Path, help="the cache folder to build the stand-in in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.carry:
        print(carry(cache_root() / MODEL, args.carry))
    elif args.small and args.cache:
        print(build(args.small, args.cache, args.seed))
    else:
        parser.error("--carry DIR, or --from DIR --cache DIR")


if __name__ == "__main__":
    main()
