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


NOALIAS = "tirx.noalias"


def declare_cache_kernels_noalias() -> None:
    """Mark the KV cache's kernels as taking distinct buffers, as the model's own kernels are (the
    cache never passes one array twice). TVM writes them without `tirx.noalias`, and one of them
    (CPU tree attention) makes TVM's LLVM code generator put every load and store of the library
    in one alias set: prefill's matmul then stored its partial sums to memory at every step
    instead of keeping them in registers, 2× slower (SmolLM2's gate and up projections, 128
    tokens: 12.3 ms instead of 6.2 on one thread)."""
    replace_cache_kernels(
        lambda _, kernel: None if NOALIAS in (kernel.attrs or {}) else kernel.with_attr(NOALIAS, True)
    )
