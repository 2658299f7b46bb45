"""Measured once per machine, cached, measured again when stale, written atomically.

What a machine measures about itself (the linear kernel plan, the row plans, which weight format
runs fastest) is kept as one JSON record per machine and key under the cache folder, so that
later loads pay nothing. This module owns that idiom, once:
- `record_path(folder, *key)`: cache_root()/folder/"{prefix}{machine}-{key}-….json", the machine
  being mtp_viz.machine.machine_key() (CPU model and flags, threads, torch, BLAS); `machine_paths`
  lists this machine's records of a folder, `fingerprint` makes a short key of a text;
- `read(path, version, required, check)`: the record, or None when there is none or it is not to
  be trusted (unreadable, another version, no ISO `measured_at`, a required key missing, `check`
  false), so that the caller measures again; `valid` is the same test on an entry already read,
  `read_raw` the file as stored whatever it holds;
- `still_good(record, now)`: a settled record serves until measured again on purpose, an unsettled
  one (`settled` false: its timings were noisy) RETRY_AFTER_S;
- `write(path, record, keep)` and `write_entry(path, section, key, entry)`: whole or absent for a
  reader (a temporary file in the same folder, then os.replace); `write_atomically(path, save)`
  does the same for a binary cache written by `save(temporary_path)`. A write that fails (a
  read-only cache) is logged and returns False: the measurement still serves this process;
- `stamp(seconds)` and `load_average()`: when, and under what load, a record was measured.
"""

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from mtp_viz.machine import machine_key
from mtp_viz.paths import cache_root

log = logging.getLogger(__name__)

RETRY_AFTER_S = 3600.0  # an unsettled record (noisy timings) serves this long, then a load measures again
MEASURED_AT = "measured_at"  # every record says when it was measured (ISO 8601)

Check = Callable[[dict], bool]  # a record kind's own test of what it holds


def record_path(folder: str, *key: str, prefix: str = "") -> Path:
    """Where this machine's record for `key` lies: cache_root()/folder/"{prefix}{machine}-{key…}.json"."""
    return cache_root() / folder / f"{prefix}{'-'.join((machine_key(), *key))}.json"


def machine_paths(folder: str, prefix: str = "") -> list[Path]:
    """This machine's record files in `folder` (every key)."""
    return sorted((cache_root() / folder).glob(f"{prefix}{machine_key()}-*.json"))


def fingerprint(text: str) -> str:
    """A short stable key of `text` (shapes, a config): 10 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def read_raw(path: Path) -> dict:
    """The record at `path` as stored, whatever it holds ({} when none is readable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def valid(data: object, version: int, required: tuple[str, ...] = (), check: Check | None = None) -> bool:
    """Whether `data` is a record to trust: a dict of this `version`, measured at an ISO time,
    holding every `required` key, and passing `check`."""
    if not isinstance(data, dict) or data.get("version") != version:
        return False
    try:
        datetime.fromisoformat(data[MEASURED_AT])
    except (KeyError, TypeError, ValueError):
        return False
    return all(key in data for key in required) and (check is None or bool(check(data)))


def read(path: Path, version: int, required: tuple[str, ...] = (), check: Check | None = None) -> dict | None:
    """The record at `path`, or None when there is none or it is not `valid` (measure it again)."""
    data = read_raw(path)
    return data if valid(data, version, required, check) else None


def still_good(record: dict, now: float, retry_after_s: float = RETRY_AFTER_S) -> bool:
    """A settled record serves until measured again on purpose; an unsettled one `retry_after_s`
    after it was measured (a record without `settled` counts as settled)."""
    age = now - datetime.fromisoformat(record[MEASURED_AT]).timestamp()
    return bool(record.get("settled", True)) or 0 <= age < retry_after_s


def write_atomically(path: Path, save: Callable[[Path], None], what: str = "the record") -> bool:
    """`save(temporary)` into a file of this process's own in `path`'s folder, then moved onto
    `path` in one step: a reader (another process loading too) sees it whole or not at all.
    False (and a warning) when it could not be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # this writer's own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save(tmp)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.warning("could not cache %s in %s: %s", what, path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def write(path: Path, record: dict, keep: tuple[str, ...] = (), what: str = "the record") -> bool:
    """Store `record` at `path` atomically; the sections named in `keep` that the stored record
    has and `record` lacks are carried over (a plan measured again keeps its row plans)."""
    old = read_raw(path) if keep else {}
    record = {**{k: old[k] for k in keep if k in old and k not in record}, **record}
    return write_atomically(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1)), what)


def write_entry(path: Path, section: str, key: str, entry: dict, what: str = "the record") -> bool:
    """Store `entry` as record[section][key] in the record at `path`, the rest of it as it was."""
    record = read_raw(path)
    if not isinstance(record.get(section), dict):
        record[section] = {}
    record[section][key] = entry
    return write(path, record, what=what)


def stamp(seconds: float) -> str:
    """A record's `measured_at`: the UTC time `seconds` (time.time()) in ISO 8601, to the second."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15-minute load averages (None where the OS keeps none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None
