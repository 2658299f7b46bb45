"""One visibility rule: the forwards' causal and tree masks and the trace's depths come from it."""

import subprocess
import sys

import pytest
import torch

from mtp_viz.kv_slots import RowKeys
from mtp_viz.trace import DraftToken, EmittedToken, Step
from mtp_viz.visibility import causal, causal_after, node_depths, tree_visibility


@pytest.mark.parametrize("past, n", [(0, 1), (0, 4), (3, 1), (5, 3)])
def test_causal_after_sees_the_past_and_the_new_tokens_up_to_itself(past, n):
    allowed = causal_after(past, n)
    assert allowed.dtype == torch.bool and allowed.device.type == "cpu" and allowed.shape == (n, past + n)
    assert torch.equal(allowed, torch.ones(n, past + n, dtype=torch.bool).tril(past))
    assert torch.equal(causal(n), causal_after(0, n))


def test_tree_nodes_see_their_ancestors_and_sit_at_their_depth():
    parents = [-1, -1, 0, 0, 2]
    seen = tree_visibility(parents)
    assert seen.dtype == torch.bool and seen.shape == (5, 5)
    assert seen[4].nonzero()[:, 0].tolist() == [0, 2, 4] and seen[3].nonzero()[:, 0].tolist() == [0, 3]
    assert node_depths(parents) == [1, 1, 2, 2, 3] == seen.sum(-1).tolist()  # a node sees one token per depth
    assert torch.equal(tree_visibility([-1, 0, 1]), causal(3))  # a chain is the causal tree


def test_step_depths_are_the_rules_depths():
    emitted = [EmittedToken(1, "bonus")]
    tree = Step(0, emitted, drafted=[DraftToken(t, "x", parent=p) for t, p in enumerate([-1, -1, 1])])
    chain = Step(0, emitted, drafted=[DraftToken(t, "x") for t in range(3)])
    assert tree.depths == node_depths([-1, -1, 1]) == [1, 1, 2]
    assert chain.depths == [1, 2, 3]


def test_row_keys_of_the_causal_rule_with_loose_rows():
    keys = RowKeys.of(None, 2, 3, "cpu", loose=(1,))
    assert keys.rows[0] == 3 and keys.rows[1] is None and keys.rows[2] == 5
    assert torch.equal(keys.batched[1][0, 0], causal_after(2, 3)[[1]])


def test_the_trace_loads_without_torch():
    code = "import sys, mtp_viz.trace; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
