"""Kiln's changes to the TIR kernels TVM's paged KV cache adds to the module being built."""

from __future__ import annotations

from typing import Callable

from tvm import relax as rx
from tvm import tirx


def replace_cache_kernels(rewrite: Callable[[str, tirx.PrimFunc], tirx.PrimFunc | None]) -> None:
    """Replace each kernel of the module being built for which `rewrite(name, kernel)` gives another."""
    builder = rx.BlockBuilder.current()
    for gvar, func in builder.get().functions_items():
        if isinstance(func, tirx.PrimFunc) and (replacement := rewrite(gvar.name_hint, func)) is not None:
            builder.update_func(gvar, replacement)
