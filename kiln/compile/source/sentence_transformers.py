"""How a sentence-transformers checkpoint turns its transformer's hidden states into an embedding:
`modules.json` lists the modules after the transformer (Pooling, whose folder's config.json names the
pooling; Dense modules, each a folder with its config.json and weights, as EmbeddingGemma has; Normalize);
the longest input is `sentence_bert_config.json`'s `max_seq_length` (written by
sentence-transformers before 6), else the tokenizer's `model_max_length` (where 6 keeps it). Every
file is read from inside the source folder, bounded in size and checked field by field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiln.compile.source.containment import check_contained, contained_file, source_root
from kiln.errors import KilnError, one_line
from kiln.models import SentenceEmbedding
from kiln.models.embedding import DENSE_ACTIVATIONS, POOLING_MODES, DenseLayer

MODULES_FILE = "modules.json"
SETTINGS_FILE = "sentence_bert_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SIDE_FILES = (MODULES_FILE, SETTINGS_FILE)
NO_LENGTH_LIMIT = 1 << 20  # transformers writes 1e30 for a tokenizer without a longest input
LARGEST_FILE = 1 << 20  # these files hold a few lines
# Module types by the last part of their Python name (sentence-transformers 2 to 6 move them between packages).
TRANSFORMER, POOLING, DENSE, NORMALIZE = "Transformer", "Pooling", "Dense", "Normalize"
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
    after_dense = kinds[2:].count(DENSE)
    if kinds[:2] != [TRANSFORMER, POOLING] or kinds[2 + after_dense :] not in ([], [NORMALIZE]):
        raise KilnError(
            f"modules {' → '.join(kinds) or '(none)'}: Kiln computes a Transformer, then Pooling, then any "
            "Dense modules, then optionally Normalize",
            path,
        )
    return listed


def module_folder(folder: Path, module: tuple[str, str], modules_path: Path) -> Path:
    kind, name = module
    relative = PurePosixPath(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise KilnError(f"the {kind} module's path {name!r} should be a folder inside the model folder", modules_path)
    return folder / relative


def module_config(folder: Path, module: tuple[str, str], modules_path: Path) -> Path:
    path = module_folder(folder, module, modules_path) / "config.json"
    if not path.is_file():
        raise KilnError(f"missing: modules.json names this {module[0]} module's config", path)
    contained_file(path, source_root(folder))
    return path


def dense_layer(config, path: Path) -> DenseLayer:
    """A Dense module's config.json: its sizes, bias and activation; a residual Dense is refused."""
    if not isinstance(config, dict):
        raise KilnError("malformed: not a JSON object", path)
    sizes = [config.get(key) for key in ("in_features", "out_features")]
    if not all(isinstance(size, int) and not isinstance(size, bool) and 0 < size <= 1 << 16 for size in sizes):
        raise KilnError(f"in_features and out_features should be positive sizes, got {sizes}", path)
    bias = config.get("bias", True)
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    name = activation.rsplit(".", 1)[-1] if isinstance(activation, str) else None
    if not isinstance(bias, bool) or name not in DENSE_ACTIVATIONS or config.get("use_residual", False) is not False:
        raise KilnError(
            f"a Dense module of bias {bias!r}, activation {activation!r}, use_residual "
            f"{config.get('use_residual', False)!r}: Kiln computes {' or '.join(DENSE_ACTIVATIONS)} without a residual",
            path,
        )
    return DenseLayer(*sizes, bias=bias, activation=name)


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


@dataclass(frozen=True)
class SentenceModules:
    """What a checkpoint's modules.json says and where it was read: the embedding's settings, the side
    files read, and the folder of each Dense module (its weights are "dense.<i>.linear.*" to the model)."""

    embedding: SentenceEmbedding
    files: list[Path]
    dense_folders: list[Path]


def read_sentence_modules(folder: Path) -> SentenceModules | None:
    """The checkpoint's pooling, Dense modules, normalization and longest input; None for a folder
    without modules.json."""
    check_contained(folder, SIDE_FILES)
    modules_path = folder / MODULES_FILE
    if not modules_path.is_file():
        return None
    modules = module_types(read_small_json(modules_path), modules_path)
    pooling_config = module_config(folder, modules[1], modules_path)
    dense = [module for module in modules if module[0] == DENSE]
    dense_configs = [module_config(folder, module, modules_path) for module in dense]
    layers = tuple(dense_layer(read_small_json(path), path) for path in dense_configs)
    for before, after, path in zip(layers, layers[1:], dense_configs[1:]):
        if after.in_features != before.out_features:
            raise KilnError(f"in_features {after.in_features}: the Dense before it gives {before.out_features}", path)
    settings = folder / SETTINGS_FILE
    embedding = SentenceEmbedding(
        pooling=pooling_mode(read_small_json(pooling_config), pooling_config),
        dense=layers,
        normalize=modules[-1][0] == NORMALIZE,
        max_sequence_length=longest_input(settings, "max_seq_length")
        or longest_input(folder / TOKENIZER_CONFIG, "model_max_length"),
    )
    files = [modules_path, pooling_config, *dense_configs, *[settings] * settings.is_file()]
    return SentenceModules(embedding, files, [path.parent for path in dense_configs])
