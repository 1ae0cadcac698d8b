"""The phone CPU targets and their bundles. `android-cpu`: the bundle's runtime sources build with its
CMake project and link line, here for aarch64 Linux (no Android NDK can be had), and chat under
qemu-aarch64 with the android-cpu model archive as the native engine does. `iphone-cpu`: Kiln's
runtime compiled for arm64 iOS needs nothing an iOS app lacks (libSystem, libc++)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from helpers.mobile_app import CHAT_DRIVER, greedy_arm64_reply
from helpers.mobile_objects import CPU_TYPE_ARM64, PLATFORM_IOS, ObjectHeader, archive_members, object_header

from kiln.compile.toolchain.system_lib import defined_globals, llvm_tool, run_tool
from kiln.compile.toolchain.mobile_runtime import RUNTIME_PLATFORMS, zig_command, zig_path
from kiln.engine import Engine, GenerationConfig
from kiln.mobile.package import LINK_LINES, package

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Tell me about the history of the city"}]
APP_PROJECT = "cmake_minimum_required(VERSION 3.18)\nproject(app C CXX)\nadd_executable(app app.c)\n{link}\n"
# What CMake needs to build for aarch64 Linux with this machine's clang, as the NDK's toolchain file
# does for Android.
CROSS_TOOLCHAIN = [
    "-DCMAKE_SYSTEM_NAME=Linux",
    "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
    "-DCMAKE_C_COMPILER=clang",
    "-DCMAKE_CXX_COMPILER=clang++",
    "-DCMAKE_C_COMPILER_TARGET=aarch64-linux-gnu",
    "-DCMAKE_CXX_COMPILER_TARGET=aarch64-linux-gnu",
    "-DCMAKE_EXE_LINKER_FLAGS=-fuse-ld=lld",
]
# Mach-O names of libc++ and libc++abi (an Xcode app links them with -lc++), and the linker's own
# ___dso_handle: std:: and __cxxabiv1:: names, operator new/delete, the C++ ABI's entry points.
LIBCXX_SYMBOL = re.compile(
    r"^_(_Z(T[VIST])?N?K?(St|10__cxxabiv1)|_Z(nw|na|dl|da)|__cxa_|__gxx_personality|__dso_handle)"
)


@pytest.fixture(scope="module")
def phone_model(tiny_build):
    return tiny_build("q4f32_1", ["cpu", "android-cpu", "iphone-cpu"])


def bundle_for(platform: str, model_dir, tmp_path):
    config = tmp_path / "kiln-package.json"
    model_entry = {"model": str(model_dir), "model_id": "tiny", "bundle_weight": True}
    config.write_text(json.dumps({"platforms": [platform], "model_list": [model_entry]}))
    return package(config, tmp_path / "out")[platform]


def run(command: list[str], **kwargs) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    assert result.returncode == 0, f"{command[:3]}: {(result.stderr or result.stdout)[-4000:]}"


def test_an_android_cpu_bundle_builds_with_its_cmake_project_and_chats_as_the_native_engine(phone_model, tmp_path):
    bundle = bundle_for("android-cpu", phone_model, tmp_path)
    assert LINK_LINES["android-cpu"] in (bundle / "BUNDLE.md").read_text()
    assert (bundle / "java" / "ai" / "kiln" / "KilnEngine.java").is_file()
    (bundle / "app.c").write_text(CHAT_DRIVER.read_text())
    (bundle / "CMakeLists.txt").write_text(APP_PROJECT.format(link=LINK_LINES["android-cpu"]))
    build = tmp_path / "build"
    run(["cmake", "-S", str(bundle), "-B", str(build), "-G", "Ninja", *CROSS_TOOLCHAIN])
    run(["ninja", "-C", str(build)])

    # No model_lib: the engine finds the model's system library by the prefix its build record names.
    reply = greedy_arm64_reply(build / "app", {"model": str(bundle / "tiny")}, QUESTION, 16)
    assert reply.status == 0, reply.message
    expected = Engine(phone_model).generate_chat(QUESTION, GenerationConfig(max_tokens=16, temperature=0))
    assert reply.content == expected.text


def libsystem_symbols() -> set[str]:
    """What macOS's libSystem exports (zig's .tbd of it): iOS's exports the same C library."""
    tbd = (zig_path().parent / "lib" / "libc" / "darwin" / "libSystem.tbd").read_text()
    return set(re.findall(r"[\s'\[,](_[A-Za-z0-9_$.]+)", tbd))


def undefined_symbols(obj) -> set[str]:
    listed = run_tool([llvm_tool("llvm-nm"), "--undefined-only", "--format=just-symbols", str(obj)])
    return {line for line in listed.splitlines() if line}


def test_an_iphone_cpu_bundle_needs_only_what_an_ios_app_links(phone_model, tmp_path):
    bundle = bundle_for("iphone-cpu", phone_model, tmp_path)
    assert (bundle / "include" / "module.modulemap").is_file()
    objects = []
    for archive in ("libkiln.a", "libmodel_iphone-cpu.a"):
        for name, body in archive_members((bundle / "lib" / archive).read_bytes()).items():
            assert object_header(body) == ObjectHeader("macho", CPU_TYPE_ARM64, PLATFORM_IOS), f"{archive}({name})"
            objects.append(tmp_path / f"{archive}-{name}")
            objects[-1].write_bytes(body)
    defined = {symbol for obj in objects for symbol in defined_globals(obj)}
    needed = {symbol for obj in objects for symbol in undefined_symbols(obj)} - defined
    unresolved = sorted(s for s in needed - libsystem_symbols() if not LIBCXX_SYMBOL.match(s))
    assert unresolved == [], "symbols no iOS library defines"
    # An app's C compiles against kiln.h for iOS.
    compiler = zig_command(RUNTIME_PLATFORMS["iphone"], "cc")
    run(
        [
            *compiler,
            "-std=c99",
            "-Wall",
            "-Werror",
            "-c",
            "-o",
            str(tmp_path / "app.o"),
            f"-I{bundle / 'include'}",
            str(CHAT_DRIVER),
        ]
    )
