"""A build killed with `kill -9` leaves no model folder, the next build into the same output
removes what it left, a live build's staging folder is never touched, and a failing build ends the
compiles it started. Also: the `cpu`
library's instruction set (portable by default) and the build record's public fields."""

from __future__ import annotations

import json
import os
import signal
import time
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import tvm

from kiln.compile.pipeline import BuildRequest, build
from kiln.compile.staging import remove_abandoned, staging_folder
from kiln.errors import KilnError
from kiln.runtime import library_path, missing_cpu_features

STAGING_PREFIX = ".kiln-build-"


def compile_until(
    source: Path, output: Path, report: str, targets: str = "cpu", temp: Path | None = None
) -> list[psutil.Process]:
    """Starts `kiln compile` (with `temp` as its TMPDIR) and kills it with SIGKILL once it prints a
    line starting `kiln: <report>`; returns the processes it had started."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "compile",
            str(source),
            "-q",
            "q0f32",
            "-t",
            targets,
            "--jobs",
            "2",
            "-o",
            str(output),
            "--model-id",
            "killed",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **({"TMPDIR": str(temp)} if temp else {})},
    )
    seen, children = [], []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(f"kiln: {report}"):
            children = psutil.Process(process.pid).children(recursive=True)
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "".join(seen)
    return children


@pytest.mark.slow
def test_a_killed_build_takes_its_compile_processes_with_it(tiny_source, tmp_path):
    """A compile outliving its build would write into a staging folder the next build removes. The
    compiles' work folders are in that staging folder too, not left in the system's temporary one."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    # Killed while the wasm compile still runs (a tiny model's takes longer than its cpu one).
    children = compile_until(tiny_source, tmp_path / "dist", "compile cpu done", targets="cpu,wasm", temp=temp)
    assert children, "the build compiles its two targets in processes of their own"
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert list(temp.iterdir()) == []


@pytest.mark.slow
def test_a_build_that_fails_ends_the_compiles_running_beside_it(tiny_source, tmp_path, monkeypatch):
    """A running compile cannot be cancelled: left alone, the program would wait for it at exit (a
    real model's wasm compile: minutes after its error line)."""
    from kiln.compile import pipeline, side_by_side

    workers = []

    def failing_convert(*args):
        # Fail once both compiles run (a compile still queued is cancelled, and idle compile processes
        # stay for the next build); the build's compile processes, not the test session's others.
        pool = side_by_side._pool
        deadline = time.monotonic() + 60
        while sum(item.future.running() for item in list(pool._pending_work_items.values())) < 2:
            assert time.monotonic() < deadline, "the compiles did not start"
            time.sleep(0.05)
        workers.extend(psutil.Process(process.pid) for process in pool._processes.values())
        raise KilnError("no space left on device")

    monkeypatch.setattr(pipeline, "convert_weights", failing_convert)
    with pytest.raises(KilnError, match="no space left"):
        build(BuildRequest(str(tiny_source), "q0f32", ["cpu", "wasm"], tmp_path / "dist", "failing", jobs=2))
    assert workers, "the build compiles its two targets in processes of their own"
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive


@pytest.mark.slow
def test_a_killed_build_leaves_no_model_folder_and_the_next_build_cleans_up(tiny_source, tmp_path):
    output = tmp_path / "dist"
    leftovers = []
    for stage in ("convert", "compile cpu"):
        compile_until(tiny_source, output, f"{stage} …")
        assert not (output / "killed").exists()
        leftovers.append(list(output.glob(f"{STAGING_PREFIX}*")))
    # The second build removed what the first left, and left its own.
    assert len(leftovers[0]) == len(leftovers[1]) == 1 and leftovers[0] != leftovers[1]
    assert (leftovers[1][0] / "model" / "tensor-cache.json").exists()

    result = build(
        BuildRequest(
            source=str(tiny_source),
            quantization="q0f32",
            targets=["cpu"],
            output=output,
            model_id="killed",
            cpu_tuning="host",
        )
    )
    assert sorted(p.name for p in output.iterdir()) == ["killed"]
    record = json.loads((result.model_dir / "kiln-build.json").read_text())
    assert record["targets"]["cpu"]["mcpu"] == tvm.target.codegen.llvm_get_system_cpu()
    assert record["targets"]["cpu"]["cpu_tuning"] == "host"
    assert library_path(result.model_dir, "cpu").is_file()


def test_a_live_builds_staging_folder_is_kept_and_a_dead_ones_removed(tmp_path):
    dead = tmp_path / f"{STAGING_PREFIX}dead"
    (dead / "model").mkdir(parents=True)
    (dead / "owner.lock").touch()  # nobody holds its lock
    with staging_folder(tmp_path, STAGING_PREFIX) as live:
        assert not dead.exists()
        assert remove_abandoned(tmp_path, STAGING_PREFIX) == [] and live.is_dir()
    assert not live.exists()


def test_the_cpu_library_is_portable_by_default_and_the_record_names_no_local_folder(tiny_build, tiny_source):
    model_dir = tiny_build("q4f32_1", ["cpu"])
    record = json.loads((model_dir / "kiln-build.json").read_text())
    assert record["targets"]["cpu"]["cpu_tuning"] == "portable"
    assert record["targets"]["cpu"]["mcpu"] in ("x86-64-v3", "generic")
    assert record["source"] == tiny_source.name
    assert str(tiny_source.parent) not in (model_dir / "kiln-build.json").read_text()


def test_a_library_for_a_cpu_this_machine_does_not_have_is_refused_with_one_line(tiny_build, tmp_path):
    import shutil

    richer = next(
        cpu
        for cpu in tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"}))
        if missing_cpu_features(str(cpu))
    )
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_build("q4f32_1", ["cpu"]), model_dir)
    record = json.loads((model_dir / "kiln-build.json").read_text())
    record["targets"]["cpu"] |= {"mcpu": str(richer), "cpu_tuning": "host"}
    (model_dir / "kiln-build.json").write_text(json.dumps(record))
    with pytest.raises(KilnError, match=f"built for the {richer} CPU and this machine's lacks .*--cpu-tuning legacy"):
        library_path(model_dir, "cpu")
