"""Which position sees which: the one attention-visibility rule every forward and the trace share.

A sequence is causal: a token sees itself and every token before it. A token tree hangs off the
last token of the sequence: node i follows `parents[i]` (−1: the root, that last token), sits one
position deeper than its parent, and sees itself and its ancestors. A chain is the tree whose
parents are i − 1. The matrices are bool "may attend" (row: the token attending) on the CPU.

torch is imported where a matrix is built: the trace (plain data, read by the views) takes its
depths from here without loading it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each tree node (1 for children of the root, parent −1); parents precede children."""
    depth: list[int] = []
    for i, parent in enumerate(parents):
        assert parent < i, "a node's parent must come before it"
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def causal(n: int) -> "torch.Tensor":
    """(n, n) bool lower triangle: n tokens each seeing itself and those before it."""
    import torch

    return torch.ones(n, n, dtype=torch.bool).tril()


def causal_after(past: int, n: int) -> "torch.Tensor":
    """(n, past + n) bool: n new tokens see the cached past and the new tokens up to themselves."""
    import torch

    allowed = torch.ones(n, past + n, dtype=torch.bool)
    allowed[:, past:] = causal(n)
    return allowed


def tree_visibility(parents: list[int]) -> "torch.Tensor":
    """(n, n) bool: node i may attend to node j iff j is i or one of its ancestors."""
    import torch

    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] |= seen[parent]
    return seen
