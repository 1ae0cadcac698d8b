"""`kiln package` on two tiny models: one bundle per platform that an app could link, and bad
configs refused with one line and nothing written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.mobile_objects import archive_members

from kiln.cli import main
from kiln.compile.toolchain.system_lib import LIBRARY_BIN_SYMBOL, llvm_tool, system_lib_prefix
from kiln.mobile.package import package

PLATFORMS = ["android", "iphone"]


@pytest.fixture(scope="module")
def two_models(tiny_build) -> list[Path]:
    return [tiny_build("q4f16_1", PLATFORMS), tiny_build("q4f32_1", PLATFORMS)]


def write_config(folder: Path, config: dict) -> Path:
    path = folder / "kiln-package.json"
    path.write_text(json.dumps(config))
    return path


def two_model_config(models: list[Path], **changes) -> dict:
    return {
        "platforms": PLATFORMS,
        **changes,
        "model_list": [
            {"model": str(models[0]), "model_id": "tiny-f16", "bundle_weight": True},
            {
                "model": str(models[1]),
                "model_id": "tiny-f32",
                "bundle_weight": False,
                "model_url": "https://example.com/tiny-f32",
                "estimated_vram_bytes": 1 << 20,
            },
        ],
    }


def test_two_models_two_bundles(two_models, tmp_path):
    bundles = package(write_config(tmp_path, two_model_config(two_models)), tmp_path / "out")
    assert {p: b.name for p, b in bundles.items()} == {"android": "bundle-android", "iphone": "bundle-iphone"}
    prefixes = [system_lib_prefix(m.name) for m in two_models]
    for platform, bundle in bundles.items():
        app_config = json.loads((bundle / "mlc-app-config.json").read_text())
        assert app_config["model_list"] == [
            {
                "model_id": "tiny-f16",
                "model_lib": prefixes[0][:-1],
                "model_path": "tiny-f16",
                "estimated_vram_bytes": app_config["model_list"][0]["estimated_vram_bytes"],
            },
            {
                "model_id": "tiny-f32",
                "model_lib": prefixes[1][:-1],
                "model_url": "https://example.com/tiny-f32",
                "estimated_vram_bytes": 1 << 20,
            },
        ]
        assert app_config["model_list"][0]["estimated_vram_bytes"] > 0
        for name in ("tensor-cache.json", "params_shard_0.bin", "mlc-chat-config.json", "tokenizer.json"):
            assert (bundle / "tiny-f16" / name).read_bytes() == (two_models[0] / name).read_bytes()
        assert not (bundle / "tiny-f32").exists() and not (bundle / "tiny-f16" / "libs").exists()

        members = archive_members((bundle / "lib" / f"libmodel_{platform}.a").read_bytes())
        assert {prefix for prefix in prefixes for name in members if name.startswith(prefix)} == set(prefixes)
        readme = (bundle / "BUNDLE.md").read_text()
        assert "0.27.0" in readme and f"libmodel_{platform}.a" in readme

    # The real test of one archive for two models: a linker keeps every member without a clash.
    archive = bundles["android"] / "lib" / "libmodel_android.a"
    linked = tmp_path / "linked.o"
    subprocess.run([llvm_tool("ld.lld", "lld"), "-r", "--whole-archive", str(archive), "-o", str(linked)], check=True)
    symbols = subprocess.run(
        [llvm_tool("llvm-nm"), "--defined-only", "--extern-only", "--format=just-symbols", str(linked)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {p + LIBRARY_BIN_SYMBOL for p in prefixes} <= set(symbols)


def test_repackaging_replaces_a_bundle(two_models, tmp_path):
    config = two_model_config(two_models)
    config["model_list"] = config["model_list"][:1]
    package(write_config(tmp_path, config), tmp_path / "out")
    config["model_list"][0]["model_id"] = "renamed"
    bundle = package(write_config(tmp_path, config), tmp_path / "out")["android"]
    assert sorted(p.name for p in bundle.iterdir()) == [
        "BUNDLE.md",
        "include",
        "java",
        "lib",
        "mlc-app-config.json",
        "renamed",
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bundle-android", "bundle-iphone"]


def bad_configs(models: list[Path], tmp_path: Path) -> dict[str, tuple[dict, str]]:
    """name → (config, what the error must say)."""
    missing = two_model_config(models)
    missing["model_list"][1]["model"] = str(tmp_path / "no-such-model")
    duplicate = two_model_config(models)
    duplicate["model_list"][1]["model_id"] = "tiny-f16"
    same_model_twice = two_model_config(models)
    same_model_twice["model_list"][1]["model"] = str(models[0])
    no_url = two_model_config(models)
    del no_url["model_list"][1]["model_url"]
    typo = two_model_config(models)
    typo["model_list"][0]["bundle_weights"] = True
    return {
        "missing model": (missing, "is not a compiled model folder"),
        "duplicate model id": (duplicate, "duplicate model_id 'tiny-f16'"),
        "same model twice": (same_model_twice, "duplicate compiled model"),
        "unknown platform": (two_model_config(models, platforms=["android", "windows"]), "unknown platform 'windows'"),
        "platform not built": (two_model_config(models, platforms=["metal"]), "has no metal library"),
        "no weights for the app": (no_url, 'give "model_url"'),
        "unknown key": (typo, "unknown key(s) bundle_weights"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing model",
        "duplicate model id",
        "same model twice",
        "unknown platform",
        "platform not built",
        "no weights for the app",
        "unknown key",
    ],
)
def test_bad_config_is_one_line_and_writes_nothing(two_models, tmp_path, capsys, case):
    config, message = bad_configs(two_models, tmp_path)[case]
    path = write_config(tmp_path, config)
    out = tmp_path / "out"
    assert main(["package", "--config", str(path), "--output", str(out)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"kiln: error: {path}: ") and message in error, error
    assert not out.exists()
