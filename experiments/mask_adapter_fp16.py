"""The shipped mask-token adapter stored in float16 instead of float32 (half the bytes: the tree the
GPU tool carries is limited to 64 MiB): its held-out scores before and after, by the trainer's own
validation (mtp_viz.training.mask.validate) on the fixed Spec-Bench answers, and how far its mask
slots' logits move.

    nice .venv/bin/python experiments/mask_adapter_fp16.py [ADAPTER_DIR]
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtp_viz.drafters.mask import MASK_ONLY, SPEC_FILE, WEIGHTS_FILE, load_mask_model
from mtp_viz.kernels import stock_linears
from mtp_viz.loading import load_model, quiet_transformers
from mtp_viz.paths import ASSETS
from mtp_viz.training.heldout import spec_bench_heldout
from mtp_viz.training.mask import MaskTrainConfig, fitted, student_and_teacher, validate, validation_packs


def main() -> None:
    quiet_transformers()
    shipped = Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS / "mtp" / "smollm2-135m-mask"
    saved = json.loads((shipped / "training.json").read_text())["config"]
    fields = MaskTrainConfig.__dataclass_fields__
    cfg = MaskTrainConfig(**{k: v for k, v in saved.items() if k in fields and k != "loop"})
    target = load_model("smollm2-135m", "cpu", "float32")
    packs = validation_packs([fitted(s, cfg.max_len) for s in spec_bench_heldout(target)], cfg)
    with tempfile.TemporaryDirectory() as tmp:
        half = Path(tmp)
        save_file({n: t.half() for n, t in load_file(shipped / WEIGHTS_FILE).items()}, half / WEIGHTS_FILE)
        (half / SPEC_FILE).write_text((shipped / SPEC_FILE).read_text())
        results, logits = {}, {}
        for name, path in (("float32", shipped), ("float16", half)):
            view = load_mask_model(target.model, path)
            mask_id = view.mtp_mask_spec.mask_token_id
            shared = view.mtp_mask_spec.gating == MASK_ONLY
            with stock_linears(view), torch.no_grad():
                results[name] = validate(view, packs, mask_id, shared)
                logits[name] = torch.cat([student_and_teacher(view, p, mask_id, shared, grad=False)[0] for p in packs])
            print(name, (path / WEIGHTS_FILE).stat().st_size, "bytes", json.dumps(results[name]), flush=True)
    a, b = logits["float32"], logits["float16"]
    same = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(
        f"mask slots scored: {len(a)}; argmax the same at {same:.4%}; largest logit change "
        f"{float((a - b).abs().max()):.2e} (logits up to {float(a.abs().max()):.1f})"
    )


if __name__ == "__main__":
    main()
