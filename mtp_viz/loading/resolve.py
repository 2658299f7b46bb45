"""The top of loading: a model as a caller names it → a LoadSpec → the pipeline. Here, and only
here, `--weights auto` becomes a format: read from the record of the choice measured on this
machine (mtp_viz.weights_auto), and when there is none, measured now by loading the model in
every format through the pipeline and comparing them."""

import logging
import threading
from dataclasses import replace

from mtp_viz import weights_auto
from mtp_viz.loading import pipeline
from mtp_viz.loading.loaded import LoadedModel
from mtp_viz.loading.spec import LoadSpec, load_spec
from mtp_viz.weights import AUTO, FORMATS, FP32

log = logging.getLogger(__name__)

_choosing = threading.Lock()  # one measurement of a model's formats at a time


def load_model(
    name: str | None, device: str | None = None, dtype: str | None = None, weights: str = FP32
) -> LoadedModel:
    """A registry id, a local Hugging Face model directory or None (the device's default) → the
    loaded model (cached per process), its linear layers in weight format `weights`
    (mtp_viz.weights; auto: the one measured best here, the record saying why)."""
    spec = load_spec(name, device, dtype)
    if weights != AUTO:
        return pipeline.load(replace(spec, weights=weights))
    fmt, why = auto_format(spec)
    return replace(pipeline.load(replace(spec, weights=fmt)), weights_why=why)


def auto_format(spec: LoadSpec) -> tuple[str, str | None]:
    """The format `auto` stands for and why: measured once per machine on the model itself, or on
    its root for a model derived from another (a draft, an adapter); on a CPU in float32 only,
    elsewhere the model runs as asked (fp32)."""
    root = replace(spec.root, weights=FP32)
    if root.torch_device.type != "cpu" or root.dtype != "float32":
        return FP32, None
    with _choosing:
        reference = pipeline.load(root)
        record = weights_auto.cached_record(root.name, reference.model)
        if record is None:
            log.warning("measuring %s's weight formats on this machine once (agreement and speed, ~1 min)", root.name)
            record = weights_auto.measure({fmt: pipeline.load(replace(root, weights=fmt)) for fmt in FORMATS})
            weights_auto.save_record(root.name, reference.model, record)
    why = weights_auto.describe_record(record)
    log.info("weights auto for %s: %s", root.name, why)
    return record["chosen"], why
