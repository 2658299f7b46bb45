"""Loading models and drafters, one way down: spec → sources / derive → pipeline → resolve → drafters."""

from mtp_viz.loading.derive import early_exit_view
from mtp_viz.loading.drafters import DrafterRequest, Drafting, load_drafting, load_heads_for  # noqa: I001 (above resolve)
from mtp_viz.loading.eagle3 import eagle3_dir, eagle3_entry, load_eagle3_for
from mtp_viz.loading.loaded import LoadedModel, encode_prompt, shared_vocab_size
from mtp_viz.loading.pipeline import forget, load_lock, retuned
from mtp_viz.loading.resolve import load_model
from mtp_viz.loading.sources import HUB_ID, display_name, hub_reachable, is_model_dir, quiet_transformers
from mtp_viz.loading.spec import DTYPES, LoadSpec, model_name, resolve_device, resolve_dtype

__all__ = [
    "DTYPES",
    "HUB_ID",
    "DrafterRequest",
    "Drafting",
    "LoadSpec",
    "LoadedModel",
    "display_name",
    "eagle3_dir",
    "eagle3_entry",
    "early_exit_view",
    "encode_prompt",
    "forget",
    "hub_reachable",
    "is_model_dir",
    "load_drafting",
    "load_eagle3_for",
    "load_heads_for",
    "load_lock",
    "load_model",
    "model_name",
    "quiet_transformers",
    "resolve_device",
    "resolve_dtype",
    "retuned",
    "shared_vocab_size",
]
