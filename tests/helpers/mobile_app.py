"""An app of Kiln's C API: tests/mobile/drivers/chat.c built against a mobile runtime and run, on arm64
under qemu-aarch64, line by line (`create`, `chat`, `stop-after`, `abort-after`, `reset`, `tokenize`)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi

from helpers.host_cpp import compiled
from helpers.paths import CHECKOUT

from kiln.compile.toolchain.mobile_runtime import (
    KILN_SOURCES_DIR,
    RUNTIME_PLATFORMS,
    ensure_mobile_runtime,
    platform_flags,
)
from kiln.compile.toolchain.wasm_toolchain import HEADERS_DIR

CHAT_DRIVER = CHECKOUT / "tests" / "mobile" / "drivers" / "chat.c"
LOGITS_DRIVER = CHECKOUT / "tests" / "mobile" / "drivers" / "logits.cc"
ARM64_SYSROOT = "/usr/aarch64-linux-gnu"
REPLY_TIMEOUT_S = 600


def build_chat_app(platform: str, output_dir: Path) -> Path:
    """chat.c as a C99 program of `platform`, linked against that platform's libkiln.so."""
    return build_against_runtime(platform, CHAT_DRIVER, output_dir, ["clang", "-std=c99", "-Wall", "-Werror"])


def build_model_driver(platform: str, output_dir: Path) -> Path:
    """logits.cc, a C++ program over the runtime's model layer (model.h), for `platform`."""
    headers = [f"-I{KILN_SOURCES_DIR}", *(f"-I{path}" for path in tvm_include_dirs())]
    return build_against_runtime(platform, LOGITS_DRIVER, output_dir, ["clang++", "-std=c++17", *headers])


def build_against_runtime(platform: str, driver: Path, output_dir: Path, compiler: list[str]) -> Path:
    runtime = ensure_mobile_runtime(platform, progress=False)
    command = [
        *compiler,
        *platform_flags(RUNTIME_PLATFORMS[platform]),
        "-fuse-ld=lld",
        f"-I{runtime / 'include'}",
        str(driver),
        f"-L{runtime / 'lib'}",
        "-lkiln",
        "-lpthread",
        f"-Wl,-rpath,{runtime / 'lib'}",
    ]
    return compiled(command, output_dir / f"{driver.stem}-{platform}")


def tvm_include_dirs() -> list[Path]:
    """TVM's headers as the runtime build has them: the wheels', and Kiln's stand-ins for what they lack."""
    tvm_dir, ffi_dir = Path(tvm.__file__).parent, Path(tvm_ffi.__file__).parent
    dirs = [tvm_dir / "include", ffi_dir / "include", ffi_dir / "3rdparty" / "dlpack" / "include"]
    return [*dirs, HEADERS_DIR / "include"]


def run_arm64(program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["qemu-aarch64", "-L", ARM64_SYSROOT, str(program), *args],
        capture_output=True,
        text=True,
        timeout=REPLY_TIMEOUT_S,
        check=False,
    )


@dataclass
class Reply:
    chunks: list[dict] = field(default_factory=list)
    status: int = 0
    code: str | None = None
    message: str = ""

    @property
    def content(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content", "") for c in self.chunks if c["choices"])

    @property
    def finish_reason(self) -> str | None:
        finishes = [c["choices"][0]["finish_reason"] for c in self.chunks if c["choices"]]
        return next((reason for reason in finishes if reason), None)

    @property
    def usage(self) -> dict:
        return self.chunks[-1]["usage"]


def read_status(line: str, reply: Reply) -> Reply:
    """`reply` with the app's "status <n> <code or -> <message>" line (without "status ")."""
    status, code, message = (line.split(" ", 2) + [""])[:3]
    reply.status, reply.code, reply.message = int(status), None if code == "-" else code, message
    return reply


class ChatApp:
    """One running app process; `qemu` runs an arm64 one here."""

    def __init__(self, program: Path, qemu: bool, env: dict | None = None):
        command = ["qemu-aarch64", "-L", ARM64_SYSROOT, str(program)] if qemu else [str(program)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    def _send(self, line: str) -> None:
        assert "\n" not in line
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def _reply(self) -> Reply:
        reply = Reply()
        for line in self.process.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "chunk":
                reply.chunks.append(json.loads(rest))
            elif kind == "status":
                return read_status(rest, reply)
            else:
                raise AssertionError(f"unexpected line from the app: {line!r}")
        raise AssertionError(f"the app ended (exit {self.process.wait()}): {self.process.stderr.read()[-4000:]}")

    def create(self, config: dict | str) -> Reply | None:
        """None when the engine was created, else the failure."""
        self._send("create " + (config if isinstance(config, str) else json.dumps(config)))
        line = self.process.stdout.readline()
        if line == "created\n":
            return None
        kind, _, rest = line.rstrip("\n").partition(" ")
        assert kind == "status", f"unexpected line from the app: {line!r} {self.process.stderr.read()[-4000:]}"
        return read_status(rest, Reply())

    def chat(self, request: dict | str, stop_after: int = 0, abort_after: int = 0) -> Reply:
        body = request if isinstance(request, str) else json.dumps(request)
        if stop_after:
            self._send(f"stop-after {stop_after} {body}")
        elif abort_after:
            self._send(f"abort-after {abort_after} {body}")
        else:
            self._send(f"chat {body}")
        return self._reply()

    def pull(self, request: dict) -> Reply:
        self._send(f"pull {json.dumps(request)}")
        return self._reply()

    def pull_and_drop(self, request: dict, after: int) -> list[dict]:
        """The first `after` chunks of a reply whose stream is then dropped."""
        self._send(f"pull-drop {after} {json.dumps(request)}")
        chunks = []
        for line in self.process.stdout:
            if line == "dropped\n":
                return chunks
            kind, _, rest = line.rstrip("\n").partition(" ")
            assert kind == "chunk", f"unexpected line from the app: {line!r}"
            chunks.append(json.loads(rest))
        raise AssertionError(f"the app ended (exit {self.process.wait()}): {self.process.stderr.read()[-4000:]}")

    def reset(self) -> Reply:
        self._send("reset")
        return self._reply()

    def close(self) -> int:
        """The app's exit status, once its input has ended."""
        self.process.stdin.close()
        return self.process.wait(timeout=60)


def greedy_arm64_reply(program: Path, config: dict, messages: list[dict], max_tokens: int) -> Reply:
    """One greedy reply of an arm64 app under qemu, from an engine created with `config`."""
    app = ChatApp(program, qemu=True)
    try:
        assert app.create(config) is None
        return app.chat({"messages": messages, "temperature": 0, "max_tokens": max_tokens})
    finally:
        app.close()
