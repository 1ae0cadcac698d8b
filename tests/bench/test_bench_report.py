"""`kiln bench report`: the native and browser benchmarks side by side, as JSON and a PNG chart."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from helpers.web import run_kiln

pytestmark = pytest.mark.browser


def test_report_writes_the_numbers_and_a_chart(tiny_dir, tmp_path):
    output = tmp_path / "reports" / "tiny"
    result = run_kiln(
        "bench",
        "report",
        str(tiny_dir),
        "--target",
        "wasm",
        "--output",
        str(output),
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "8",
        "--threads",
        "2",
        timeout_s=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wasm decode is" in result.stdout and "× native on 2 threads" in result.stdout

    report = json.loads(output.with_suffix(".json").read_text())
    native, wasm = report["native"], report["browser"]["wasm"]
    assert (native["target"], wasm["device"]) == ("cpu", "wasm")
    assert native["threads"] == wasm["threads"] == 2
    for key in ("load_s", "ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert native[key] > 0 and wasm[key] > 0
        assert report["ratios"]["wasm"][key] == pytest.approx(wasm[key] / native[key])

    with Image.open(output.with_suffix(".png")) as chart:
        chart.verify()
    with Image.open(output.with_suffix(".png")) as chart:
        assert chart.format == "PNG" and chart.width >= 1000 and chart.height >= 300
        # A chart, not a blank canvas: bars in several colors.
        assert len(chart.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10
    assert sorted(p.name for p in output.parent.iterdir()) == ["tiny.json", "tiny.png"]


def test_report_refuses_an_unknown_browser_device(tiny_dir, tmp_path):
    result = run_kiln(
        "bench", "report", str(tiny_dir), "--target", "vulkan", "--output", str(tmp_path / "r"), timeout_s=600
    )
    assert result.returncode == 1 and "vulkan" in result.stderr
    assert list(tmp_path.iterdir()) == []
