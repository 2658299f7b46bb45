"""What every figure shares: the plotly layout, the note drawn where there is nothing to plot,
the wide layout of multi-series figures, and a bench label's family look."""

import plotly.graph_objects as go

from mtp_viz.labels import is_peer
from mtp_viz.viz.style import FAMILY_COLOURS, FAMILY_MARKERS, PEER_COLOUR, PEER_MARKER

LAYOUT = dict(
    template="plotly_white", margin=dict(l=50, r=20, t=40, b=40), height=320, legend=dict(orientation="h", y=1.12, x=0)
)
MAX_SERIES = 8  # no figure draws more series than this: a projector can't show more


def empty_note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(
        text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14, color="#6b7280")
    )
    return fig


def family(label: str) -> str:
    """ "mtp_heads:tree=chain" → "mtp_heads": the strategy a bench label is a variant of."""
    return str(label).split(":")[0]


def family_style(label: str) -> tuple[str, str]:
    """(colour, marker) of a bench label: its family's, or the peers' grey cross."""
    if is_peer(label):
        return PEER_COLOUR, PEER_MARKER
    f = family(label)
    return FAMILY_COLOURS.get(f, "#374151"), FAMILY_MARKERS.get(f, "circle")


def wide_layout(fig: go.Figure, title: str, **extra) -> go.Figure:
    """The layout of figures with many series (bench, load): the legend below the plot, never over
    the bars, and room for it."""
    layout = {**LAYOUT, "legend": dict(orientation="h", x=0, y=-0.18, yanchor="top"), "height": 420}
    layout["margin"] = dict(l=50, r=20, t=40, b=110)
    fig.update_layout(**layout, title=title, **extra)
    return fig
