"""A build's targets compiled side by side, one process each.

TVM compiles a target on one core, and a build for the browser has three or four (cpu, webgpu,
webgpu-subgroups, wasm). Each process makes the quantized module again from the source (seconds)
and compiles one target, as a build in one process does. The processes are spawned, not forked
(the building process may run threads: a server's, a test's), and kept for the next build of the
same process, which finds them started.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Callable, Iterator

PR_SET_PDEATHSIG = 1

_pool: ProcessPoolExecutor | None = None
_pool_size = 0


def default_jobs(targets: int) -> int:
    return max(1, min(targets, os.cpu_count() or 1))


def submit(jobs: int, function: Callable, *args) -> Future:
    """Run `function(*args)` in one of `jobs` compile processes."""
    global _pool, _pool_size
    if _pool is None or _pool_size < jobs:
        if _pool is not None:
            _pool.shutdown(wait=False)
        context = multiprocessing.get_context("spawn")
        _pool = ProcessPoolExecutor(
            max_workers=jobs, mp_context=context, initializer=follow_the_build, initargs=(os.getpid(),)
        )
        _pool_size = jobs
    try:
        with main_script_left_out():
            return _pool.submit(function, *args)
    except BrokenProcessPool:  # a compile process died (killed, out of memory) in an earlier build
        _pool = None
        return submit(jobs, function, *args)


def stop() -> None:
    """End the compile processes now, with the compiles they run (a running future cannot be
    cancelled, and the interpreter would wait for it at exit: minutes after a build failed)."""
    global _pool, _pool_size
    if _pool is None:
        return
    for process in list(_pool._processes.values()):  # the executor has no public way to end its workers
        process.kill()
    _pool.shutdown(wait=False, cancel_futures=True)
    _pool, _pool_size = None, 0


@contextmanager
def main_script_left_out() -> Iterator[None]:
    """Spawn the compile processes without the program's own script, which they do not need: spawning
    runs it again in each, and a script calling `build` without `if __name__ == "__main__"` would
    start its builds again there. (Processes start within `submit`.)"""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def follow_the_build(build_pid: int) -> None:
    """A compile process ends with the build that started it: Ctrl-C is the build's to handle, and a
    compile outliving a killed build would write into a folder the next build removes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != build_pid:  # the build died before the line above
        os._exit(1)
