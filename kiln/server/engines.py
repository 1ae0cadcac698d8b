"""The native engines behind the API: one per model, loaded on first use, released when idle or
over the budget of loaded models.

A request leases its model's engine (`NativeEngines.lease`) and lets go of it when its reply ends.
An engine under lease is never released, so the next request for that model finds the same engine
rather than loading a second copy beside it. Past the budget, the engines under lease stay and the
budget is restored as they are let go and the next request comes. A model takes at most
`max_queue` requests waiting behind the one it runs; more get a 503 with `Retry-After` at once.

Loading holds a lock of its own model only, so a model that loads (seconds for a large one) never
holds up requests to models already loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flask import Response

from kiln.app_config import compiled_models
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.speculative import Speculation

from .api_request import ApiError

log = logging.getLogger(__name__)
LONGEST_IDLE_CHECK_S = 30.0
# How long a client told the model is busy waits before asking again (about one short reply).
RETRY_AFTER_S = 2


class ModelBusy(ApiError):
    """A 503 telling the client when to ask again."""

    def __init__(self, message: str):
        super().__init__(503, message, error_type="server_error", code="model_busy")

    def response(self) -> Response:
        response = super().response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


@dataclass
class Slot:
    """A model's place in the pool: its load lock, once loaded its engine, and the leases on it."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # held while loading or releasing
    engine: object | None = None  # a kiln.engine.Engine, or a kiln.embeddings.EmbeddingEngine
    requested_at: float = 0.0  # time.monotonic() of the last request for it, at its start and at its end
    leases: int = 0  # requests holding the engine (or waiting for it to load); guarded by the pool's lock

    def last_used(self) -> float:
        return max(self.requested_at, self.engine.last_active)

    def release(self) -> bool:
        """Drop the engine unless it is loading, under lease or generating."""
        if self.leases or not self.lock.acquire(blocking=False):
            return False
        try:
            if self.engine is None or self.engine.busy:
                return False
            self.engine = None
            return True
        finally:
            self.lock.release()


class Lease:
    """A request's hold on a model's engine, from the moment it is handed out until `release()`
    (which may be called more than once: a stream's end and its closing both call it)."""

    def __init__(self, engine, let_go: Callable[[], None]):
        self.engine = engine
        self._let_go: Callable[[], None] | None = let_go
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            let_go, self._let_go = self._let_go, None
        if let_go is not None:
            let_go()


class NativeEngines:
    """The native engines of the models under `dist` that have a library for `target`.

    `idle_unload_s` (0: never) releases an engine unused that long; `max_loaded` (0: no limit)
    releases the least recently used ones past that many; `max_queue` requests may wait for a
    model behind the one it runs (each up to `queue_timeout_s`)."""

    def __init__(
        self,
        dist: Path,
        target: str,
        queue_timeout_s: float,
        idle_unload_s: float = 0.0,
        max_loaded: int = 0,
        max_queue: int = 64,
        speculation: Speculation | None = None,
    ):
        self.dist = dist
        self.speculation = speculation
        self.target = target
        self.queue_timeout_s = queue_timeout_s
        self.idle_unload_s = idle_unload_s
        self.max_loaded = max_loaded
        self.max_queue = max_queue
        self.slots: dict[str, Slot] = {}
        self.lock = threading.Lock()  # guards `slots` and `reaper`; never held while a model loads
        self.reaper: threading.Thread | None = None

    def model_ids(self) -> list[str]:
        return [m.model_id for m in compiled_models(self.dist) if self.target in m.libraries]

    def lease(self, model_id: str) -> Lease:
        """The model's engine, loaded if need be, held until the lease is released."""
        slot = self._slot(model_id)
        self._take(model_id, slot)
        try:
            with slot.lock:
                if slot.engine is None:
                    slot.engine = self._load(model_id)
                slot.requested_at = time.monotonic()
                engine = slot.engine
        except BaseException:
            self._let_go(slot)
            raise
        self.release_unused(keep=model_id)
        self._watch_idle()
        return Lease(engine, lambda: self._let_go(slot))

    def load(self, model_id: str):
        """The model's engine: an EmbeddingEngine for an embedding model, else a chat Engine."""
        from kiln.embeddings import EmbeddingEngine
        from kiln.engine import Engine

        model_dir = self.dist / model_id
        if "embedding" in read_json(model_dir / "mlc-chat-config.json"):
            return EmbeddingEngine(model_dir, self.target, busy_timeout_s=self.queue_timeout_s)
        return Engine(model_dir, self.target, busy_timeout_s=self.queue_timeout_s, speculation=self.speculation)

    def loaded(self) -> list[str]:
        with self.lock:
            return sorted(model_id for model_id, slot in self.slots.items() if slot.engine is not None)

    def release_unused(self, keep: str | None = None) -> None:
        """Release the engines idle past `idle_unload_s`, then the least recently used past `max_loaded`."""
        now = time.monotonic()
        with self.lock:
            loaded = sorted(
                (
                    (model_id, slot)
                    for model_id, slot in self.slots.items()
                    if slot.engine is not None and model_id != keep
                ),
                key=lambda item: item[1].last_used(),
            )
            excess = len(loaded) + (keep is not None) - self.max_loaded if self.max_loaded else 0
            for _, slot in loaded:
                idle = self.idle_unload_s and now - slot.last_used() >= self.idle_unload_s
                if (idle or excess > 0) and slot.release():
                    excess -= 1

    def _take(self, model_id: str, slot: Slot) -> None:
        with self.lock:
            if slot.leases > self.max_queue:  # one generating, `max_queue` waiting
                raise ModelBusy(f"{self.max_queue} requests already wait for the model {model_id!r}; retry later.")
            slot.leases += 1

    def _let_go(self, slot: Slot) -> None:
        """A request ends: the engine's idle time counts from now (its reply may have been read long
        after the model finished it)."""
        with self.lock:
            slot.leases -= 1
            slot.requested_at = time.monotonic()

    def _load(self, model_id: str):
        try:
            return self.load(model_id)
        except KilnError as e:
            log.error("the model %s cannot be loaded: %s", model_id, e)
            # The problem, not the path: clients learn nothing of the server's folders.
            message = f"The model {model_id!r} cannot be loaded: {e.problem}"
            raise ApiError(500, message, error_type="server_error", code="model_load_failed") from None

    def _slot(self, model_id: str) -> Slot:
        with self.lock:
            if model_id in self.slots:
                return self.slots[model_id]
        ids = self.model_ids()
        if model_id not in ids:
            raise ApiError(
                404,
                f"The model {model_id!r} does not exist here (models with a {self.target} "
                f"library: {', '.join(ids) or 'none'})",
                "model",
                code="model_not_found",
            )
        with self.lock:
            return self.slots.setdefault(model_id, Slot())

    def _watch_idle(self) -> None:
        """Run the idle reaper while any engine is loaded (it ends itself when none is)."""
        with self.lock:
            if self.idle_unload_s and self.reaper is None:
                self.reaper = threading.Thread(target=self._reap, name="kiln-idle-unload", daemon=True)
                self.reaper.start()

    def _reap(self) -> None:
        while True:
            time.sleep(min(self.idle_unload_s / 4, LONGEST_IDLE_CHECK_S))
            self.release_unused()
            with self.lock:
                if all(slot.engine is None for slot in self.slots.values()):
                    self.reaper = None
                    return
