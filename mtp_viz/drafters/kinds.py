"""The kinds of drafter a strategy drafts with. A strategy names the kinds it can use, best first;
each kind loads what it needs against a loaded target (mtp_viz.loading.drafters)."""

from enum import StrEnum


class DrafterKind(StrEnum):
    DRAFT_MODEL = "draft_model"  # a smaller model with the target's vocabulary (registry `drafts`)
    HEADS = "heads"  # MTP heads on the target's last hidden state (registry `heads`)
    MASKS = "masks"  # the target's mask-token MTP model: its weights plus a mask token and adapter
    EAGLE3 = "eagle3"  # an EAGLE-3 layer reading the target's features (registry `eagle3`)
