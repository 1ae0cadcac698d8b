"""The native engines behind the API: one per model, loaded on first use, released when idle or
over the budget of loaded models.

Loading holds a lock of its own model only, so a model that loads (seconds for a large one) never
holds up requests to models already loaded. An engine that is generating is never released; one
released while a request still holds it (between being handed out and starting) lives until that
request lets go of it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.app_config import compiled_models

from .api_request import ApiError

LONGEST_IDLE_CHECK_S = 30.0


@dataclass
class Slot:
    """A model's place in the pool: its load lock and, once loaded, its engine."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # held while loading or releasing
    engine: object | None = None  # a kiln.engine.Engine
    requested_at: float = 0.0  # time.monotonic() of the last request for it

    def last_used(self) -> float:
        return max(self.requested_at, self.engine.last_active)

    def release(self) -> bool:
        """Drop the engine unless it is loading, handed out right now or generating."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.engine is None or self.engine.busy:
                return False
            self.engine = None
            return True
        finally:
            self.lock.release()


class NativeEngines:
    """The native engines of the models under `dist` that have a library for `target`.

    `idle_unload_s` (0: never) releases an engine unused that long; `max_loaded` (0: no limit)
    releases the least recently used ones past that many."""

    def __init__(
        self, dist: Path, target: str, queue_timeout_s: float, idle_unload_s: float = 0.0, max_loaded: int = 0
    ):
        self.dist = dist
        self.target = target
        self.queue_timeout_s = queue_timeout_s
        self.idle_unload_s = idle_unload_s
        self.max_loaded = max_loaded
        self.slots: dict[str, Slot] = {}
        self.lock = threading.Lock()  # guards `slots` and `reaper`; never held while a model loads
        self.reaper: threading.Thread | None = None

    def model_ids(self) -> list[str]:
        return [m.model_id for m in compiled_models(self.dist) if self.target in m.libraries]

    def get(self, model_id: str):
        slot = self._slot(model_id)
        with slot.lock:
            if slot.engine is None:
                slot.engine = self.load(model_id)
            slot.requested_at = time.monotonic()
            engine = slot.engine
        self.release_unused(keep=model_id)
        self._watch_idle()
        return engine

    def load(self, model_id: str):
        from kiln.engine import Engine

        return Engine(self.dist / model_id, self.target, busy_timeout_s=self.queue_timeout_s)

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
