"""mtp-viz: an instrumented explorer for speculative decoding and multi-token prediction."""

__version__ = "0.1.0"
