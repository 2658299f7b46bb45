"""Traces in and out of the app as files: a download written under a name of ours (in the app's
temporary folder, once per content), an upload checked for size, encoding and schema before it
becomes a Trace."""

from pathlib import Path

from mtp_viz.errors import InvalidTraceError
from mtp_viz.trace import Trace
from mtp_viz.ui.temp_files import download_file

MAX_TRACE_BYTES = 8 * 1024 * 1024  # uploads above this are refused


def trace_file(trace: Trace) -> str:
    """A trace as a file to download; the name is ours, never the user's."""
    name = f"trace-{trace.strategy}-{trace.model}.json".replace("/", "_")
    return str(download_file(name, trace.to_json(indent=1)))


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
