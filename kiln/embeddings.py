"""Embeddings natively: an embedding model's library (kiln/models/embedding.py) on the TVM runtime,
behind OpenAI's embeddings request and response (`EmbeddingEngine.create`).

The contract the browser engine mirrors (web/src/embeddings.js), step by step:
- each input is tokenized without special tokens, cut on the right to leave room for them, then
  wrapped in the ones the model's tokenizer adds to a single text (`prefix_token_ids`, `suffix_token_ids`);
  an input longer than the model's `max_sequence_length` so keeps its beginning, as sentence-transformers does;
- inputs run in batches of at most `max_batch_size`, longest first, each padded to its longest with
  an attention mask (an input's vector does not depend on the batch it runs in);
- the pooled vector is cut to `dimensions` (the full width, or a length the model was trained to
  give: Matryoshka), then scaled to unit length when the model normalizes.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm

from kiln.engine import EngineError, acquire_or_busy
from kiln.errors import KilnError, one_line
from kiln.model_folder import read_json
from kiln.runtime import CompiledLibrary, on_compute_thread
from kiln.text import load_tokenizer

MOST_INPUTS = 2048  # per request, as OpenAI's embeddings API
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """OpenAI's embeddings request, checked: `input` a string or a list of them."""

    texts: list[str]
    dimensions: int | None = None
    encoding_format: str = "float"

    @classmethod
    def parse(cls, request: dict) -> EmbeddingRequest:
        texts = request.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts:
            raise EngineError("bad-request", "input should be a string or a non-empty list of strings")
        if len(texts) > MOST_INPUTS:
            raise EngineError("bad-request", f"input holds {len(texts)} texts; a request takes at most {MOST_INPUTS}")
        for index, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise EngineError("bad-request", f"input[{index}] should be a non-empty string, got {text!r:.40}")
        dimensions = request.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
            raise EngineError("bad-request", f"dimensions should be a whole number, got {dimensions!r:.40}")
        encoding_format = request.get("encoding_format") or "float"
        if encoding_format not in ENCODING_FORMATS:
            raise EngineError("bad-request", f"encoding_format should be float or base64, got {encoding_format!r:.40}")
        return cls(texts, dimensions, encoding_format)


@dataclass(frozen=True)
class EmbeddingSettings:
    """The `embedding` section of an embedding model's mlc-chat-config.json."""

    pooling: str
    normalize: bool
    dimensions: int
    matryoshka_dimensions: tuple[int, ...]
    max_sequence_length: int
    max_batch_size: int
    prefix_token_ids: tuple[int, ...]
    suffix_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, chat_config: dict) -> EmbeddingSettings:
        fields = {name: chat_config["embedding"][name] for name in cls.__dataclass_fields__}
        for name in ("matryoshka_dimensions", "prefix_token_ids", "suffix_token_ids"):
            fields[name] = tuple(fields[name])
        return cls(**fields)

    def width(self, dimensions: int | None) -> int:
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        if dimensions not in self.matryoshka_dimensions:
            allowed = ", ".join(str(d) for d in (self.dimensions, *self.matryoshka_dimensions))
            raise EngineError("bad-request", f"dimensions {dimensions}: this model gives embeddings of {allowed}")
        return dimensions

    def token_ids(self, text_ids: list[int]) -> list[int]:
        """An input's ids as the model runs them: cut on the right, wrapped in the special tokens."""
        room = self.max_sequence_length - len(self.prefix_token_ids) - len(self.suffix_token_ids)
        return [*self.prefix_token_ids, *text_ids[:room], *self.suffix_token_ids]


def batches(lengths: list[int], most: int) -> list[list[int]]:
    """Indices of inputs in batches of at most `most`, longest first (least padding)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[start : start + most] for start in range(0, len(order), most)]


def finished_vectors(pooled: np.ndarray, width: int, normalize: bool) -> np.ndarray:
    vectors = pooled[:, :width].astype(np.float32)
    if normalize:
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), np.float32(1e-12))
    return vectors


def encoded(vector: np.ndarray, encoding_format: str):
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingModel(CompiledLibrary):
    """An embedding model's library: token ids in, pooled vectors out."""

    embedding = True

    def __init__(self, model_dir: Path, target: str = "cpu"):
        super().__init__(model_dir, target)
        self.settings = EmbeddingSettings.of(self.chat_config)

    def pooled(self, inputs: list[list[int]]) -> np.ndarray:
        """One pooled vector per input (each within the model's longest input), [len(inputs), width]."""
        out = np.empty((len(inputs), self.settings.dimensions), np.float32)
        for batch in batches([len(ids) for ids in inputs], self.settings.max_batch_size):
            out[batch] = on_compute_thread(self._run_batch, [inputs[i] for i in batch])
        return out

    def _run_batch(self, inputs: list[list[int]]) -> np.ndarray:
        longest = max(len(ids) for ids in inputs)
        ids = np.zeros((len(inputs), longest), np.int32)
        mask = np.zeros_like(ids)
        for row, input_ids in enumerate(inputs):
            ids[row, : len(input_ids)] = input_ids
            mask[row, : len(input_ids)] = 1
        try:
            vectors = self.vm["sentence_embeddings"](
                tvm.runtime.tensor(ids, self.device), tvm.runtime.tensor(mask, self.device), self.params
            )
        except Exception as e:  # a check that failed in TVM's runtime
            raise KilnError(f"the model's embedding failed in TVM: {one_line(e) or type(e).__name__}", self.model_dir)
        return vectors.numpy()


class EmbeddingEngine:
    """An embedding model ready to embed texts: `create` answers an OpenAI embeddings request. One
    request runs at a time; another waits up to `busy_timeout_s` (default 0), then gets EngineBusy."""

    def __init__(self, model_dir: Path, target: str = "cpu", busy_timeout_s: float = 0.0):
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model = EmbeddingModel(self.model_dir, target)
        self.settings = self.model.settings
        self.chat_config = self.model.chat_config
        self.model_id = read_json(self.model_dir / "kiln-build.json").get("model_id", self.model_dir.name)
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self.last_active = time.monotonic()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [self.settings.token_ids(encoding.ids) for encoding in encodings]

    def embed(self, texts: list[str], dimensions: int | None = None) -> np.ndarray:
        """The texts' embeddings, [len(texts), dimensions]."""
        return self.create_vectors(EmbeddingRequest.parse({"input": texts, "dimensions": dimensions}))[0]

    def create(self, request: dict) -> dict:
        """OpenAI's embeddings response to `request` (its `model` field is not read: this engine's model answers)."""
        asked = EmbeddingRequest.parse(request)
        vectors, prompt_tokens = self.create_vectors(asked)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": index, "embedding": encoded(vector, asked.encoding_format)}
                for index, vector in enumerate(vectors)
            ],
            "model": self.model_id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }

    def create_vectors(self, asked: EmbeddingRequest) -> tuple[np.ndarray, int]:
        width = self.settings.width(asked.dimensions)
        inputs = self.token_ids(asked.texts)
        acquire_or_busy(self._lock, self.busy_timeout_s, f"the engine for {self.model_id} is busy with another request")
        try:
            pooled = self.model.pooled(inputs)
        finally:
            self.last_active = time.monotonic()
            self._lock.release()
        return finished_vectors(pooled, width, self.settings.normalize), sum(len(ids) for ids in inputs)
