"""Libraries compiled before, reused (`kiln compile --library-cache DIR`): a target whose compile would
be an earlier one's gets a copy of that library instead, as fine-tunes of one base model share MLC's
prebuilt model libraries. A compile is named by a digest of what makes it: the model's exported module
(its Relax functions, kernels and metadata, by TVM's 64-bit structural hash: TVM's printer and JSON
writer crash on some of Kiln's modules), the target, the system library's prefix, and the Kiln code and
toolchain that compile it (`salts`, per target)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi

from kiln.compile.toolchain.system_lib import static_archive_path
from kiln.targets import TargetEntry

PLANNED_STORAGE = "planned-storage.json"


def target_outputs(entry: TargetEntry, library: Path) -> dict[str, Path]:
    """The files a target's compile writes, by role: its library, and its static archive or kernel source."""
    outputs = {"library": library}
    if entry.system_lib:
        outputs["archive"] = static_archive_path(library)
    if entry.kernel_source:
        outputs["kernels"] = entry.kernel_source_path(library)
    return outputs


@dataclass(frozen=True)
class LibraryCache:
    folder: Path
    salts: dict[str, str]  # target name → the Kiln code and toolchain versions that compile it

    def key(self, mod: tvm.IRModule, entry: TargetEntry, system_lib_prefix: str | None) -> str:
        digest = hashlib.sha256()
        module_hash = str(tvm_ffi.structural_hash(mod))
        for part in (self.salts[entry.name], str(entry.target()), system_lib_prefix or "", module_hash):
            digest.update(part.encode() + b"\0")
        return digest.hexdigest()

    def fetch(self, key: str, entry: TargetEntry, library: Path) -> dict[str, list[int]] | None:
        """Copy the entry's files in under the names a build gives `library`'s; returns the library's
        planned storage, or None when there is no entry."""
        stored = self.folder / key
        if not (stored / PLANNED_STORAGE).is_file():
            return None
        for role, output in target_outputs(entry, library).items():
            shutil.copyfile(stored / role, output)
        return json.loads((stored / PLANNED_STORAGE).read_text())

    def store(self, key: str, entry: TargetEntry, library: Path, planned: dict[str, list[int]]) -> None:
        """Keep a compile's files; written aside and renamed into place, so an entry is whole or absent."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".entry-", dir=self.folder) as work:
            staged = Path(work) / key
            staged.mkdir()
            for role, output in target_outputs(entry, library).items():
                shutil.copyfile(output, staged / role)
            (staged / PLANNED_STORAGE).write_text(json.dumps(planned))
            try:
                os.rename(staged, self.folder / key)
            except OSError:  # another build stored the same compile first
                pass
