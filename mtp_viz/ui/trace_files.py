"""Traces in and out of the app as files: a download written under a name of ours, an upload
checked for size, encoding and schema before it becomes a Trace."""

import tempfile
from pathlib import Path

from mtp_viz.errors import InvalidTraceError
from mtp_viz.trace import Trace

MAX_TRACE_BYTES = 8 * 1024 * 1024  # uploads above this are refused


def trace_file(trace: Trace) -> str:
    """Write a trace to a fresh temporary file for download; the name is ours, never the user's."""
    folder = Path(tempfile.mkdtemp(prefix="mtp-viz-"))
    path = folder / f"trace-{trace.strategy}-{trace.model}.json".replace("/", "_")
    trace.save(path)
    return str(path)


def read_uploaded_trace(path: str | None) -> Trace:
    """Validate an uploaded trace file (size first, then JSON and schema)."""
    if not path:
        raise InvalidTraceError("no file was uploaded")
    size = Path(path).stat().st_size
    if size > MAX_TRACE_BYTES:
        raise InvalidTraceError(f"the file has {size:,} bytes; traces up to {MAX_TRACE_BYTES:,} bytes are accepted")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidTraceError("the file is not UTF-8 text") from None
    return Trace.from_json(text)
