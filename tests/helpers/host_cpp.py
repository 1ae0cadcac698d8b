"""Host builds of the mobile runtime's C++ sources for unit tests: a small driver from tests/mobile/drivers
and the runtime sources it needs, compiled for this machine and linked against the tvm-ffi wheel's
library (its JSON and containers), in seconds rather than the minutes of a whole runtime build."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import tvm_ffi

from helpers.paths import CHECKOUT

RUNTIME_SOURCES = CHECKOUT / "kiln" / "mobile" / "runtime"
DRIVERS = CHECKOUT / "tests" / "mobile" / "drivers"
TVM_FFI = Path(tvm_ffi.__file__).parent


def host_program(driver: str, runtime_sources: list[str], output_dir: Path) -> Path:
    """tests/mobile/drivers/`driver` with kiln/mobile/runtime/`runtime_sources`, built into `output_dir`."""
    program = output_dir / Path(driver).stem
    command = [
        "clang++",
        "-std=c++17",
        "-O1",
        "-g",
        "-Wall",
        "-Werror",
        f"-I{RUNTIME_SOURCES}",
        f"-I{TVM_FFI / 'include'}",
        f"-I{TVM_FFI / '3rdparty' / 'dlpack' / 'include'}",
        str(DRIVERS / driver),
        *(str(RUNTIME_SOURCES / source) for source in runtime_sources),
        f"-L{TVM_FFI / 'lib'}",
        "-ltvm_ffi",
        f"-Wl,-rpath,{TVM_FFI / 'lib'}",
    ]
    return compiled(command, program)


def compiled(command: list[str], program: Path) -> Path:
    """`program`, built by `command` (a compiler line without its `-o`)."""
    command = [*command, "-o", str(program)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{subprocess.list2cmdline(command)}\n{result.stderr[-4000:]}"
    return program


class DriverProcess:
    """A driver kept running: a JSON request line in, a JSON answer line out."""

    def __init__(self, *command: str | Path):
        self.process = subprocess.Popen(
            list(map(str, command)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8"
        )

    def ask(self, request):
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the driver stopped (exit status {self.process.wait()}) on {request!r}"
        return json.loads(answer)

    def close(self) -> None:
        self.process.stdin.close()
        assert self.process.wait(timeout=10) == 0
