"""How a sentence-transformers checkpoint turns its transformer's hidden states into an embedding:
`modules.json` lists the modules after the transformer (Pooling, whose folder's config.json names the
pooling; Normalize); the longest input is `sentence_bert_config.json`'s `max_seq_length` (written by
sentence-transformers before 6), else the tokenizer's `model_max_length` (where 6 keeps it). Every
file is read from inside the source folder, bounded in size and checked field by field.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from kiln.compile.source.containment import check_contained, contained_file, source_root
from kiln.errors import KilnError, one_line
from kiln.models import SentenceEmbedding
from kiln.models.embedding import POOLING_MODES

MODULES_FILE = "modules.json"
SETTINGS_FILE = "sentence_bert_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SIDE_FILES = (MODULES_FILE, SETTINGS_FILE)
NO_LENGTH_LIMIT = 1 << 20  # transformers writes 1e30 for a tokenizer without a longest input
LARGEST_FILE = 1 << 20  # these files hold a few lines
# Module types by the last part of their Python name (sentence-transformers 2 to 6 move them between packages).
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"
# sentence-transformers before 5 wrote the pooling as one flag per mode.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_small_json(path: Path):
    if path.stat().st_size > LARGEST_FILE:
        raise KilnError(f"larger than {LARGEST_FILE >> 10} KiB: not a sentence-transformers file", path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise KilnError(f"malformed JSON ({one_line(error)})", path) from None


def module_types(modules, path: Path) -> list[tuple[str, str]]:
    """(type, folder) of each module, in order."""
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise KilnError("should be a list of modules ({idx, name, path, type})", path)
    listed = []
    for module in modules:
        kind, folder = module.get("type"), module.get("path", "")
        if not isinstance(kind, str) or not isinstance(folder, str):
            raise KilnError(f"a module's type and path should be strings, got {module!r}", path)
        listed.append((kind.rsplit(".", 1)[-1], folder))
    kinds = [kind for kind, _ in listed]
    if kinds[:2] != [TRANSFORMER, POOLING] or any(kind != NORMALIZE for kind in kinds[2:]):
        raise KilnError(
            f"modules {' → '.join(kinds) or '(none)'}: Kiln computes a Transformer, then Pooling, then "
            "optionally Normalize (a Dense or other module after them is not supported)",
            path,
        )
    return listed


def pooling_folder(folder: Path, name: str, modules_path: Path) -> Path:
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise KilnError(f"the Pooling module's path {name!r} should be a folder inside the model folder", modules_path)
    return folder / relative


def pooling_mode(config, path: Path) -> str:
    if not isinstance(config, dict):
        raise KilnError("malformed: not a JSON object", path)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in POOLING_FLAGS.items() if config.get(flag) is True]
        mode = modes[0] if len(modes) == 1 else modes
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLING_MODES:
        raise KilnError(f"pooling {mode!r}: Kiln pools with one of {', '.join(POOLING_MODES)}", path)
    if config.get("include_prompt", True) is not True:
        raise KilnError("pooling without the prompt's tokens (include_prompt false) is not supported", path)
    return mode


def longest_input(path: Path, key: str) -> int | None:
    """A token count of a JSON file's `key`, None when it sets none (or transformers' "no limit")."""
    if not path.is_file():
        return None
    settings = read_small_json(path)
    length = settings.get(key) if isinstance(settings, dict) else None
    if (
        length is None
        or isinstance(length, (int, float))
        and not isinstance(length, bool)
        and length >= NO_LENGTH_LIMIT
    ):
        return None
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise KilnError(f"{key} should be a positive token count, got {length!r}", path)
    return length


def read_sentence_embedding(folder: Path) -> tuple[SentenceEmbedding | None, list[Path]]:
    """The checkpoint's pooling, normalization and longest input, and the files they were read from;
    (None, []) for a folder without modules.json."""
    check_contained(folder, SIDE_FILES)
    modules_path = folder / MODULES_FILE
    if not modules_path.is_file():
        return None, []
    modules = module_types(read_small_json(modules_path), modules_path)
    pooling_config = pooling_folder(folder, modules[1][1], modules_path) / "config.json"
    if not pooling_config.is_file():
        raise KilnError("missing: modules.json names this Pooling module's config", pooling_config)
    contained_file(pooling_config, source_root(folder))
    settings = folder / SETTINGS_FILE
    embedding = SentenceEmbedding(
        pooling=pooling_mode(read_small_json(pooling_config), pooling_config),
        normalize=len(modules) > 2,
        max_sequence_length=longest_input(settings, "max_seq_length")
        or longest_input(folder / TOKENIZER_CONFIG, "model_max_length"),
    )
    return embedding, [modules_path, pooling_config, *[settings] * settings.is_file()]
