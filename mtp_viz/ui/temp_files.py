"""The app's one temporary folder: the files it hands the browser to download (traces, tables),
each written once per content. The folder goes when the process exits; one left by a process that
was killed (no exit handlers ran) goes when the next app process makes its own."""

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

PREFIX = "mtp-viz-app-"  # then the owning process's id: mtp-viz-app-<pid>-<random>
_lock = threading.Lock()
_folder: list[Path] = []  # the process's folder, made on the first download


def app_temp_dir() -> Path:
    """This process's temporary folder (made once, removed at exit)."""
    with _lock:
        if not _folder:
            _remove_orphans()
            pid = os.getpid()
            folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-"))
            atexit.register(_remove, folder, pid)
            _folder.append(folder)
        return _folder[0]


def download_file(name: str, text: str) -> Path:
    """A file named `name` holding `text`, to download. Its folder is named by the content, so the
    same content (the first look's example on every page load) is written once, and two different
    files of one name never overwrite each other."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]
    path = app_temp_dir() / digest / name
    if not path.is_file():
        path.parent.mkdir(exist_ok=True)
        part = path.with_name(f".{name}.{threading.get_ident()}.part")  # whole or absent, whoever writes it too
        part.write_text(text, encoding="utf-8")
        os.replace(part, path)
    return path


def _remove(folder: Path, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the exit handler
        shutil.rmtree(folder, ignore_errors=True)


def _remove_orphans() -> None:
    """The folders of app processes that no longer run."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = folder.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
