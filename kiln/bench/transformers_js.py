"""transformers.js beside Kiln in `kiln bench embeddings --transformers-js`: the checkpoint Kiln compiled,
exported to ONNX here by torch's exporter, run by @huggingface/transformers' feature-extraction
pipeline in headless Chromium on its wasm or WebGPU backend and timed inside the page, as Kiln's
browser engine is.

Only what the page loads is fetched from npm, once, into Kiln's cache: transformers.js's bundle (ONNX
Runtime Web built in) and ONNX Runtime Web's threaded wasm, from the two packages' tarballs (no install
scripts run). The page is served cross-origin isolated, so the wasm backend gets its threads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from flask import Flask, send_from_directory

from kiln.browser.driver import chromium, serving
from kiln.compile.toolchain.wasm_toolchain import cache_dir
from kiln.errors import KilnError

PACKAGE, VERSION = "@huggingface/transformers", "4.3.1"
BUNDLE = "transformers.js"
ORT_FILES = ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
POOLINGS = ("mean", "cls")  # Kiln's poolings transformers.js' feature-extraction pipeline also has
PAGE_JS = """async ({model, device, threads, texts, runs, pooling, normalize}) => {
  const { env, pipeline } = await import("/transformers/transformers.js");
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = "/models/";
  env.useBrowserCache = false;
  env.useWasmCache = false;
  env.backends.onnx.wasm.wasmPaths = {
    mjs: "/transformers/ort-wasm-simd-threaded.asyncify.mjs",
    wasm: "/transformers/ort-wasm-simd-threaded.asyncify.wasm",
  };
  env.backends.onnx.wasm.numThreads = threads;
  const extractor = await pipeline("feature-extraction", model, { device, dtype: "fp32" });
  const seconds = [];
  let output;
  for (let run = 0; run <= runs; run += 1) {
    const start = performance.now();
    output = await extractor(texts, { pooling, normalize });
    if (run > 0) seconds.push((performance.now() - start) / 1000);
  }
  return { seconds, vectors: Array.from(output.data), width: output.dims[1] };
}"""


def npm_pack(spec: str, folder: Path) -> Path:
    """The tarball of one npm package (its dependencies are not fetched)."""
    try:
        done = subprocess.run(
            ["npm", "pack", spec, "--silent", "--pack-destination", str(folder)],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise KilnError(f"npm could not fetch {spec} for the transformers.js bench: {detail.strip()[:200]}") from None
    return folder / done.stdout.strip().splitlines()[-1]


def extract(tarball: Path, destinations: dict[str, Path]) -> None:
    """Members of an npm tarball (`package/<member>`) to their destinations, and nothing else."""
    with tarfile.open(tarball) as archive:
        for member, destination in destinations.items():
            try:
                source = archive.extractfile(f"package/{member}")
            except KeyError:
                source = None
            if source is None:
                raise KilnError(f"{tarball.name} has no {member}")
            with source, open(destination, "wb") as out:
                shutil.copyfileobj(source, out)


def transformers_js_files() -> Path:
    """The folder of the files the page loads, fetched on first use."""
    folder = cache_dir() / f"transformers-js-{VERSION}"
    if all((folder / name).is_file() for name in (BUNDLE, *ORT_FILES)):
        return folder
    with tempfile.TemporaryDirectory(prefix="kiln-transformers-js-") as scratch:
        scratch = Path(scratch)
        staged = scratch / "files"
        staged.mkdir()
        manifest = scratch / "package.json"
        bundle = {"dist/transformers.js": staged / BUNDLE, "package.json": manifest}
        extract(npm_pack(f"{PACKAGE}@{VERSION}", scratch), bundle)
        runtime = json.loads(manifest.read_text())["dependencies"]["onnxruntime-web"]  # the version it was built with
        extract(npm_pack(f"onnxruntime-web@{runtime}", scratch), {f"dist/{name}": staged / name for name in ORT_FILES})
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(staged, folder)
    return folder


def export_onnx(checkpoint: Path, folder: Path) -> None:
    """The checkpoint's transformer as `folder`/onnx/model.onnx (last_hidden_state over a batch of any
    shape), with the files transformers.js reads beside it."""
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as error:
        raise KilnError(f"--transformers-js needs torch and transformers ({error})") from None

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return self.model(**dict(zip(names, inputs))).last_hidden_state

    model = AutoModel.from_pretrained(checkpoint, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    example = tokenizer(["a text", "a longer text to pad"], padding=True, return_tensors="pt")
    names = list(example.keys())
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    (folder / "onnx").mkdir(parents=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the exporter's progress lines, off a --json report
            program = torch.onnx.export(
                LastHiddenState(model),
                tuple(example[name] for name in names),
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_shapes=(tuple({0: batch, 1: sequence} for _ in names),),
                dynamo=True,
                opset_version=18,
            )
    except ImportError as error:
        raise KilnError(f"--transformers-js exports ONNX with onnx and onnxscript ({error})") from None
    program.save(str(folder / "onnx" / "model.onnx"), external_data=False)
    for name in MODEL_FILES:
        shutil.copy(checkpoint / name, folder / name)


def transformers_js_runs(checkpoint: Path, settings, devices: list[str], texts: list[str], runs: int, threads: int):
    """Per device: (where it ran, vectors, seconds) of transformers.js on `checkpoint`'s ONNX export."""
    if settings.pooling not in POOLINGS:
        raise KilnError(f"--transformers-js: its feature-extraction pipeline has no {settings.pooling} pooling")
    files = transformers_js_files()
    results = []
    with tempfile.TemporaryDirectory(prefix="kiln-transformers-js-") as root:
        root = Path(root)
        export_onnx(checkpoint, root / "models" / "model")
        (root / "index.html").write_text("<!doctype html><title>transformers.js</title>")
        with serving(isolated_static_app(root, files)) as url:
            for device in devices:
                with chromium(root / f"profile-{device}", webgpu=device == "webgpu") as context:
                    page = context.pages[0] if context.pages else context.new_page()
                    page.goto(url + "index.html")
                    asked = {"model": "model", "device": device, "threads": threads, "texts": texts, "runs": runs}
                    asked.update(pooling=settings.pooling, normalize=settings.normalize)
                    reply = page.evaluate(PAGE_JS, asked)
                vectors = np.asarray(reply["vectors"], np.float32).reshape(len(texts), reply["width"])
                where = f"transformers.js {device}" + (f" ({threads} threads)" if device == "wasm" else "")
                results.append((where, vectors, reply["seconds"]))
    return results


def isolated_static_app(root: Path, files: Path) -> Flask:
    """`root`'s page and model, and transformers.js's files under /transformers/, cross-origin isolated."""
    app = Flask(__name__)

    @app.get("/transformers/<name>")
    def transformers_file(name: str):
        return send_from_directory(files, name, mimetype="text/javascript" if name.endswith((".js", ".mjs")) else None)

    @app.get("/<path:name>")
    def page_file(name: str):
        return send_from_directory(root, name)

    @app.after_request
    def isolated(response):
        response.headers["Cross-Origin-Opener-Policy"] = "same-origin"
        response.headers["Cross-Origin-Embedder-Policy"] = "require-corp"
        response.headers["Cross-Origin-Resource-Policy"] = "same-origin"
        return response

    return app
