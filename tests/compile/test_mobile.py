"""System libraries for Android (OpenCL), iOS and macOS (Metal): what an app links. Nothing here
can run them (no OpenCL or Metal device in the TVM runtime), so the tests read what was built: the
archive's members, their object headers, and the symbols the app's runtime looks up."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from helpers.mobile_objects import (
    CPU_TYPE_ARM64,
    EM_AARCH64,
    PLATFORM_IOS,
    PLATFORM_MACOS,
    ObjectHeader,
    archive_members,
    object_header,
)

from kiln.compile.toolchain.system_lib import LIBRARY_BIN_SYMBOL, defined_globals, system_lib_prefix

MOBILE_TARGETS = ("android", "iphone", "metal")
EXPECTED_HEADER = {
    "android": ObjectHeader("elf", EM_AARCH64),
    "iphone": ObjectHeader("macho", CPU_TYPE_ARM64, PLATFORM_IOS),
    "metal": ObjectHeader("macho", CPU_TYPE_ARM64, PLATFORM_MACOS),
    "android-cpu": ObjectHeader("elf", EM_AARCH64),
    "iphone-cpu": ObjectHeader("macho", CPU_TYPE_ARM64, PLATFORM_IOS),
}
# Mach-O spells C names with a leading underscore.
SYMBOL_PREFIX = {"android": "", "iphone": "_", "metal": "_", "android-cpu": "", "iphone-cpu": "_"}


def check_system_library(model_dir: Path, target: str, tmp_path: Path) -> None:
    build = json.loads((model_dir / "kiln-build.json").read_text())
    assert "LLVM version" in build["versions"]["llvm-ar"]
    record = build["targets"][target]
    prefix = system_lib_prefix(model_dir.name)
    assert record["system_lib_prefix"] == prefix
    archive = model_dir / record["static_library"]
    assert archive.name == f"lib{model_dir.name}-{target}.a"
    members = archive_members(archive.read_bytes())
    with tarfile.open(model_dir / record["library"]) as tar:
        assert sorted(tar.getnames()) == sorted(members), "the .tar and the .a hold different objects"
    assert members and all(name.startswith(prefix) for name in members)
    for name, body in members.items():
        assert object_header(body) == EXPECTED_HEADER[target], f"{archive.name}({name})"

    defined = []
    for name, body in members.items():
        (tmp_path / name).write_bytes(body)
        defined += defined_globals(tmp_path / name)
    symbol_prefix = SYMBOL_PREFIX[target]
    assert f"{symbol_prefix}{prefix}{LIBRARY_BIN_SYMBOL}" in defined
    # Every global carries the prefix, so two models never collide in one app.
    assert [s for s in defined if not s.startswith(symbol_prefix + prefix)] == []


@pytest.fixture(scope="module")
def tiny_mobile(tiny_build) -> Path:
    return tiny_build("q4f16_1", MOBILE_TARGETS)


@pytest.mark.parametrize("target", MOBILE_TARGETS)
def test_tiny_system_libraries(tiny_mobile, target, tmp_path):
    check_system_library(tiny_mobile, target, tmp_path)


def test_building_another_target_keeps_the_static_archives(tiny_build, tiny_mobile):
    archives = {p.name: p.read_bytes() for p in (tiny_mobile / "libs").glob("*.a")}
    assert len(archives) == len(MOBILE_TARGETS)
    tiny_build("q4f16_1", [*MOBILE_TARGETS, "cpu"])
    assert {p.name: p.read_bytes() for p in (tiny_mobile / "libs").glob("*.a")} == archives


@pytest.mark.parametrize("target", ["android-cpu", "iphone-cpu"])
def test_tiny_phone_cpu_system_libraries(tiny_build, target, tmp_path):
    check_system_library(tiny_build("q4f32_1", ["cpu", target]), target, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("target", MOBILE_TARGETS)
def test_smollm2_system_libraries(smollm2_build, target, tmp_path):
    check_system_library(smollm2_build("q4f16_1", MOBILE_TARGETS), target, tmp_path)
