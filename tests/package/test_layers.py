"""The package's layers: a module imports from its own layer or the ones below it, never above, so
that the compiler never loads the engine and the engine never loads the compiler's schedules."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

# From the bottom up. A module belongs to the layer of the longest name here that it starts with.
LAYERS = (
    # errors, the formats Kiln reads and writes, the target table
    (
        "kiln",
        "kiln.errors",
        "kiln.targets",
        "kiln.model_folder",
        "kiln.model_memory",
        "kiln.tensor_cache",
        "kiln.app_config",
        "kiln.text",
        "kiln.chat_template",
        "kiln.structured",
        "kiln.tools",
    ),
    ("kiln.models",),
    ("kiln.compile",),
    (
        "kiln.runtime",
        "kiln.sampling",
        "kiln.speculative",
        "kiln.completions",
        "kiln.engine",
        "kiln.chat",
        "kiln.embeddings",
    ),
    ("kiln.server", "kiln.browser", "kiln.bench", "kiln.mobile"),
    ("kiln.cli",),
)


def layer_of(module: str) -> int:
    matches = [
        (len(name), level)
        for level, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, path: Path) -> set[str]:
    """The kiln modules `path` imports, at its top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            names.add(".".join([*base, *([node.module] if node.module else [])]))
    return {name for name in names if name == "kiln" or name.startswith("kiln.")}


def back_imports(root: Path) -> list[str]:
    """`importer -> imported` for every import that points up the layers."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(root, path)
        for name in sorted(imported(module, path)):
            if layer_of(name) > layer_of(module):
                found.append(f"{module} -> {name}")
    return found


def test_every_import_points_down_the_layers():
    assert back_imports(Path(kiln.__file__).parent) == []


def test_a_back_import_is_found(tmp_path):
    root = tmp_path / "kiln"
    (root / "compile").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "compile" / "__init__.py").write_text("from . import stage\n")
    (root / "compile" / "stage.py").write_text(
        "from kiln.errors import KilnError\n\ndef tokenizer():\n    from kiln.engine import Engine\n"
    )
    (root / "models.py").write_text("from .compile import stage\n")
    assert back_imports(root) == ["kiln.compile.stage -> kiln.engine", "kiln.models -> kiln.compile"]
