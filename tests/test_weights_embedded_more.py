"""Every lossless strategy token-identical to autoregressive decoding on the embedded model in
int8 and fp32 (q4 and bf16: tests/test_weights_embedded.py; a file of its own so that the suite's
workers share the load). fp32 too: its products run under the row plan measured on this machine
(on an AMD EPYC, MKL's sgemm sums a row differently at 1, 2-3 and 4+ rows; calls of 4 agree)."""

import pytest
from test_weights_embedded import assert_identical_to_autoregressive

from mtp_viz.weights import FP32, INT8

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("weights", [INT8, FP32])
def test_lossless_strategies_identical_to_autoregressive_on_the_same_weights(weights):
    assert_identical_to_autoregressive(weights)
