"""Every file Kiln reads of a source lies inside the source's folder: a link leading out of it (to a
key, a password file, another user's model) is refused, whatever the file's name."""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError


def source_root(folder: Path) -> Path:
    """The folder every file of a source must lie in: the folder itself, or for a snapshot in the
    Hugging Face cache (models--org--name/snapshots/<commit>) its repository's folder, whose
    blobs/ the snapshot's files link to."""
    folder = folder.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return folder


def contained_file(path: Path, root: Path) -> Path:
    """`path` with every link followed, if that lies inside `root` (a link within is fine)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise KilnError(
            "a link to a file outside the model folder: Kiln reads only the source's own files "
            "(copy the file in instead)",
            path,
        )
    return resolved


def check_contained(folder: Path, names: tuple[str, ...], root: Path | None = None) -> None:
    """Each of the files `names` in `folder` that exists (a dangling link counts) lies inside the source
    (`root`, by default `folder`'s source root)."""
    root = root or source_root(folder)
    for name in names:
        if (folder / name).is_symlink() or (folder / name).exists():
            contained_file(folder / name, root)
