"""The n-gram drafter on hand-made sequences."""

import numpy as np
import pytest

from mtp_viz.errors import InvalidSettingsError
from mtp_viz.strategies.prompt_lookup import PromptLookupSettings, find_draft


def test_longest_suffix_ngram_wins_and_first_occurrence_is_used():
    seq = np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix 3-gram [1, 2, 3] occurs at 0 → continuation 9, 2, 3
    assert find_draft(seq, 3, 1, 3) == ([9, 2, 3], 3, 0)
    # with n limited to 2, [2, 3] first occurs at 1 → 9, 2, 3, 7
    assert find_draft(seq, 2, 1, 4) == ([9, 2, 3, 7], 2, 1)


def test_no_match_and_min_ngram_size():
    seq = np.array([5, 6, 7, 8, 4, 9, 8])
    assert find_draft(seq, 3, 1, 4) == ([4, 9, 8], 1, 3)  # only the 1-gram [8] matches
    assert find_draft(seq, 3, 2, 4) == ([], 0, -1)
    assert find_draft(np.array([1]), 3, 1, 4) == ([], 0, -1)


def test_draft_is_cut_to_k_and_to_the_sequence():
    seq = np.array([1, 2, 3, 4, 5, 1, 2])
    assert find_draft(seq, 2, 1, 2) == ([3, 4], 2, 0)
    assert find_draft(seq, 2, 1, 50) == ([3, 4, 5, 1, 2], 2, 0)


@pytest.mark.parametrize(
    "kw",
    [
        {"min_ngram_size": 4, "max_ngram_size": 3},
        {"min_ngram_size": 0},
        {"num_draft_tokens": 0},
        {"max_ngram_size": 17},
    ],
)
def test_invalid_settings(kw):
    with pytest.raises(InvalidSettingsError):
        PromptLookupSettings(**kw)
