"""One shared style: a colour per token origin and per verdict, used by every view."""

from mtp_viz.trace import (
    ACCEPTED,
    AUTOREGRESSIVE,
    BONUS,
    ORIGINS,
    RESAMPLED,
    UNVERIFIED,
    VERDICT_REJECTED,
    VERDICT_SKIPPED,
)

ORIGIN_COLOURS = {
    AUTOREGRESSIVE: "#d1d5db",  # grey: the target alone
    ACCEPTED: "#86efac",  # green: a draft the target kept
    RESAMPLED: "#fdba74",  # orange: the target's own token at a rejection
    BONUS: "#93c5fd",  # blue: the free extra token after a fully accepted draft
    UNVERIFIED: "#d8b4fe",  # purple: emitted without verification (lossy)
}
assert set(ORIGIN_COLOURS) == set(ORIGINS)

ORIGIN_LABELS = {
    AUTOREGRESSIVE: "autoregressive",
    ACCEPTED: "accepted draft",
    RESAMPLED: "resampled at rejection",
    BONUS: "bonus",
    UNVERIFIED: "unverified",
}

REJECTED_COLOUR = "#fca5a5"  # red, struck through: a draft the target threw away
SKIPPED_COLOUR = "#f3f4f6"  # pale, struck through: a draft never judged (after a rejection)
VERDICT_COLOURS = {
    ACCEPTED: ORIGIN_COLOURS[ACCEPTED],
    VERDICT_REJECTED: REJECTED_COLOUR,
    VERDICT_SKIPPED: SKIPPED_COLOUR,
}

DRAFT_TIME_COLOUR = "#a78bfa"
VERIFY_TIME_COLOUR = "#60a5fa"
OTHER_TIME_COLOUR = "#e5e7eb"
P_COLOUR = "#2563eb"  # target probability
Q_COLOUR = "#f59e0b"  # draft probability

# Strategy families (the part of a bench label before ":"), one colour and marker each, so a
# variant reads as its family in every figure; transformers' peers share one grey family look.
FAMILY_COLOURS = {
    "autoregressive": "#6b7280",
    "speculative": "#2563eb",
    "prompt_lookup": "#16a34a",
    "lookahead": "#ca8a04",
    "self_speculative": "#9333ea",
    "mtp_heads": "#dc2626",
    "eagle": "#ea580c",
    "conf_adapt": "#db2777",
    "mask_spec": "#0891b2",
}
PEER_COLOUR = "#9ca3af"
FAMILY_MARKERS = {
    "autoregressive": "circle",
    "speculative": "square",
    "prompt_lookup": "diamond",
    "lookahead": "triangle-up",
    "self_speculative": "triangle-down",
    "mtp_heads": "star",
    "eagle": "star-diamond",
    "conf_adapt": "hexagon",
    "mask_spec": "pentagon",
}
PEER_MARKER = "x"
