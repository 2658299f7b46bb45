"""Tables as a person reads them: every figure rounded to what it can tell (speedups and ratios to
2 decimals, shares as %, rates and megabytes to 1, seconds to 3, counts with separators), blanks as
a dash. Only what is shown: the tables behind them, and their CSV downloads, keep full precision."""

from collections.abc import Callable

import pandas as pd

BLANK = "—"
# Columns holding a share of 1 (agreement, identical outputs, accuracy, acceptance), shown as %.
SHARES = {"identical to AR", "agreement", "agreement with autoregressive", "math accuracy", "identical_to_ar"}
SHARES |= {"acceptance_rate"}
COUNTS = {"extra_models", "extra_params"}  # whole numbers, float only where a row is blank


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:.{digits}f}"


def column_format(name: str) -> Callable[[float], str]:
    """How a numeric column reads; by default 2 decimals (speedups, tokens per forward, NLL)."""
    if name in SHARES:
        return lambda v: f"{v:.1%}"
    if name.endswith("error"):  # (predicted − measured) / measured
        return lambda v: f"{v:+.1%}"
    if name in COUNTS:
        return lambda v: f"{int(v):,}"
    if name.endswith(("_mb", "per_s")):  # megabytes, tokens per second
        return _fixed(1)
    if name.endswith("_s"):  # seconds (time to first token, between tokens)
        return _fixed(3)
    return _fixed(2)


def readable(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with its numeric columns as text to read (integer columns as they are)."""
    shown = table.copy()
    for name in shown.columns:
        column = shown[name]
        if pd.api.types.is_bool_dtype(column) or not pd.api.types.is_numeric_dtype(column):
            continue
        fmt = (lambda v: f"{int(v):,}") if pd.api.types.is_integer_dtype(column) else column_format(str(name))
        shown[name] = [BLANK if pd.isna(v) else fmt(v) for v in column]
    return shown
