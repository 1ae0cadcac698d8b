"""The browser engine behind the native model's interface, so everything built on
`kiln.runtime.NativeModel` (the engine's generation and sampling, parity checks) runs the same
way on a model in headless Chromium.

Each step runs in the page's engine (web/src, WebGPU or the CPU wasm library) and its full
logits come back to Python, where tokens are chosen exactly as natively. (The browser engine's
own chat completions choose them in JavaScript by the same definition: web/src/sampler.js.)
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from kiln.engine import Engine
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.runtime import library_path
from kiln.speculative import Speculation
from kiln.targets import BROWSER_TARGETS

from .driver import PageEngine, page_engine

BACKENDS = ("auto", *BROWSER_TARGETS)
FULL_LOGITS = {"full": True}


class BrowserModel:
    """A model loaded by the browser engine: prefill, decode, all_logits, rollback, reset."""

    def __init__(self, engine: PageEngine, model_dir: Path, load: dict):
        self.engine = engine
        self.model_dir = model_dir
        self.chat_config = read_json(model_dir / "mlc-chat-config.json")
        self.vocab_size = int(self.chat_config["vocab_size"])
        self.prefill_chunk_size = int(self.chat_config["prefill_chunk_size"])
        self.context_window_size = int(load["stats"]["context_window_size"])
        self.backend = load["stats"]["library_target"]  # webgpu, webgpu-subgroups or wasm
        self.adapter = load["stats"]["adapter"]
        self.load_s = load["seconds"]

    @property
    def device(self) -> str:
        return f"browser-{self.backend}"

    def prefill(self, token_ids: list[int]) -> np.ndarray:
        return self.engine.call("session.prefill", [int(t) for t in token_ids], FULL_LOGITS)["logits"]

    def decode(self, token_id: int) -> np.ndarray:
        return self.engine.call("session.decode", int(token_id), FULL_LOGITS)["logits"]

    def all_logits(self, token_ids: list[int]) -> np.ndarray:
        rows = self.engine.call("session.allLogits", [int(t) for t in token_ids], FULL_LOGITS)
        return np.stack([row["logits"] for row in rows])

    def rollback(self, count: int) -> int:
        """Forget the last `count` cached tokens; returns how many stay cached."""
        return self.engine.call("session.rollback", count)

    def reset(self) -> None:
        self.engine.call("resetChat")


def check_browser_library(model_dir: Path, backend: str) -> None:
    """Fail before starting Chromium when the folder has no library for `backend`."""
    if backend == "auto":
        built = read_json(model_dir / "kiln-build.json").get("targets", {})
        backend = next((device for device in BROWSER_TARGETS if device in built), BROWSER_TARGETS[0])
    library_path(model_dir, backend)


@contextmanager
def browser_model(
    model_dir: Path, backend: str = "auto", driver=None, threads: int | None = None, shaders: str | None = None
) -> Iterator[BrowserModel]:
    """Serve `model_dir` to a fresh headless Chromium and load it there (`backend` auto picks
    WebGPU when Chromium has it, else the CPU wasm library; `threads`: the wasm library's, `shaders`:
    when WebGPU compiles them; default the engine's choice)."""
    model_dir = Path(model_dir)
    if backend not in BACKENDS:
        raise KilnError(f"the browser runs a {' or '.join(BROWSER_TARGETS)} library (or auto), not {backend!r}")
    if not (model_dir / "kiln-build.json").is_file():
        raise KilnError("not a compiled model folder (no kiln-build.json)", model_dir)
    check_browser_library(model_dir, backend)
    with page_engine(model_dir.resolve().parent, webgpu=backend != "wasm", driver=driver) as engine:
        yield BrowserModel(engine, model_dir, engine.load(model_dir.name, backend, threads=threads, shaders=shaders))


@contextmanager
def engine_on(
    model_dir: Path, device: str, target: str | None = None, speculation: Speculation | None = None
) -> Iterator[tuple[Engine, str]]:
    """An Engine on the native runtime (`device` "native", `target` one of NATIVE_TARGETS) or on the
    browser engine (`device` "browser", `target` auto or one of BROWSER_TARGETS), and the name of
    what it runs on. `speculation` is the native engine's (kiln.speculative)."""
    if device == "native":
        yield Engine(model_dir, target or "cpu", speculation=speculation), target or "cpu"
        return
    if speculation is not None:
        raise KilnError("--speculative runs on the native engine (--device native) for now")
    with browser_model(model_dir, target or "auto") as model:
        yield Engine(model_dir, model=model), model.device
