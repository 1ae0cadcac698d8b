"""Hidden staging folders beside a build's output, and the leftovers of builds that died.

A build writes into `.kiln-build-XXXX/` under the output folder and renames the finished model
folder into place, so a model folder only ever appears complete. The staging folder's process
holds an exclusive lock on its `owner.lock` for as long as it runs. A `kill -9` leaves the folder
behind but the kernel releases the lock, so the next build into the same output removes every
staging folder whose lock it can take.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK = "owner.lock"
# A folder without its lock file is either being created this instant or was killed in that
# instant; only the second kind gets old.
UNLOCKED_GRACE_S = 600


@contextmanager
def staging_folder(parent: Path, prefix: str) -> Iterator[Path]:
    """A new hidden folder `parent/<prefix>XXXX`, removed on exit, after removing abandoned ones."""
    remove_abandoned(parent, prefix)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as tmp:
        with open(Path(tmp) / LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield Path(tmp)


def remove_abandoned(parent: Path, prefix: str) -> list[Path]:
    """Remove the staging folders under `parent` whose process has died; returns them."""
    removed = []
    for folder in parent.glob(f"{prefix}*"):
        if folder.is_dir() and abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def abandoned(folder: Path) -> bool:
    try:
        with open(folder / LOCK) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True
    except FileNotFoundError:
        return time.time() - folder.stat().st_mtime > UNLOCKED_GRACE_S


@contextmanager
def temporary_files_in(folder: Path) -> Iterator[None]:
    """Within: this process's temporary files (Python's `tempfile`, TVM's object files) and those of
    the programs it starts (emscripten) go into `folder`, which it makes."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved[1]
