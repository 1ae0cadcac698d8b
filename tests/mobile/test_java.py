"""The Java binding (kiln/mobile/java: ai.kiln.KilnEngine over kiln.h through JNI) on this machine's JVM,
against the host build of the mobile runtime: a Java app streams the native engine's reply, aborts one
from a second thread, and gets the engine's failures as KilnExceptions with their codes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.mobile_app import Reply
from helpers.paths import CHECKOUT

from kiln.compile.toolchain.mobile_runtime import ensure_mobile_runtime
from kiln.engine import Engine, GenerationConfig

pytestmark = pytest.mark.slow

JAVA_SOURCES = CHECKOUT / "kiln" / "mobile" / "java"
JAVA_APP = CHECKOUT / "tests" / "mobile" / "drivers" / "KilnChat.java"
QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]


def java_home() -> Path:
    javac = shutil.which("javac")
    assert javac, "javac (Debian's openjdk) is needed to build the Java binding"
    return Path(javac).resolve().parents[1]


@pytest.fixture(scope="module")
def java_app(tmp_path_factory) -> Path:
    """The binding's classes and libkiln_jni.so (against the host libkiln.so), with KilnChat."""
    runtime = ensure_mobile_runtime("host", progress=False)
    built = tmp_path_factory.mktemp("java")
    include = java_home() / "include"
    commands = [
        [
            "clang",
            "-std=c99",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            f"-I{include}",
            f"-I{include / 'linux'}",
            f"-I{runtime / 'include'}",
            str(JAVA_SOURCES / "kiln_jni.c"),
            f"-L{runtime / 'lib'}",
            "-lkiln",
            f"-Wl,-rpath,{runtime / 'lib'}",
            "-o",
            str(built / "libkiln_jni.so"),
        ],
        ["javac", "-Xlint:all", "-Werror", "-d", str(built), *map(str, JAVA_SOURCES.rglob("*.java")), str(JAVA_APP)],
    ]
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{subprocess.list2cmdline(command)}\n{result.stderr[-4000:]}"
    return built


def run_java(java_app: Path, config: dict, *requests: str) -> list[Reply]:
    command = ["java", f"-Djava.library.path={java_app}", "-cp", str(java_app), "KilnChat", json.dumps(config)]
    command += requests
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    replies, current = [], Reply()
    for line in result.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "chunk":
            current.chunks.append(json.loads(rest))
        else:
            assert kind == "status", line
            code, _, current.message = rest.partition(" ")
            current.code = None if code == "-" else code
            replies.append(current)
            current = Reply()
    return replies


LONGEST_REPLY = 448  # the tiny Llama's context window (512) less the question


@pytest.fixture(scope="module")
def model(tiny_build) -> Path:
    return tiny_build("q4f32_1", ["cpu"])


def test_a_java_app_streams_the_native_engines_reply_and_aborts_from_another_thread(java_app, model):
    greedy = json.dumps({"messages": QUESTION, "temperature": 0, "max_tokens": 16})
    # The engine generates on a thread of its own and queues chunks for the app: the reply must outlast the
    # app's taking of three chunks and its aborting thread (64 tiny-model tokens, ~20 ms, once did not).
    endless = json.dumps({"messages": QUESTION, "temperature": 0, "max_tokens": LONGEST_REPLY, "ignore_eos": True})
    reply, aborted, refused = run_java(java_app, {"model": str(model)}, greedy, f"abort-after 3 {endless}", "{}")
    expected = Engine(model).generate_chat(QUESTION, GenerationConfig(max_tokens=16, temperature=0))
    assert reply.code is None and reply.content == expected.text
    assert aborted.code is None and aborted.finish_reason == "abort"
    assert aborted.usage["completion_tokens"] < LONGEST_REPLY
    assert refused.code == "bad-request" and "messages must be a non-empty list" in refused.message


def test_a_folder_that_is_no_model_is_a_kiln_exception(java_app, tmp_path):
    (failure,) = run_java(java_app, {"model": str(tmp_path)})
    assert failure.code == "bad-model" and str(tmp_path) in failure.message
