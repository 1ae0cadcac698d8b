"""Kiln's changes to the TIR kernels TVM's paged KV cache adds to the module being built."""

from __future__ import annotations

from typing import Callable

from tvm import ir, tirx
from tvm import relax as rx
from tvm.relax.frontend.nn.llm.kv_cache import TIRPagedKVCache


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


def leave_out_unused_attention_kernels(cache: TIRPagedKVCache, windowed: bool) -> None:
    """Give TVM's paged KV cache no tree attention kernels (token trees: speculative decoding, which
    neither Kiln's engines nor WebLLM do) and, for a model without any window (`windowed` false),
    no sliding-window ones, and let the build drop them: each kernel costs every WebGPU load a
    pipeline, and on SwiftShader these four took 9.6 s of SmolLM2's 28–30 s.

    Without its window kernels the cache is made without window support, so that a runtime asking
    for a window (WebLLM's `sliding_window_size` option) gets TVM's error "The KV cache does not
    support sliding window." instead of calling a kernel that is not there."""
    builder = rx.BlockBuilder.current()
    call = builder.lookup_binding(cache._expr)
    unused_words = ("tree_mask",) if windowed else ("tree_mask", "sliding_window")
    left_out: list[ir.GlobalVar] = []

    def kept(arg: rx.Expr) -> rx.Expr:
        kernels = [f for f in arg.fields if isinstance(f, ir.GlobalVar)] if isinstance(arg, rx.Tuple) else []
        if any(word in kernel.name_hint for kernel in kernels for word in unused_words):
            left_out.extend(kernels)
            return rx.Tuple([])
        return arg

    packed_function, cache_config, *args = call.args
    args = [kept(arg) for arg in args]
    if not windowed:
        # The config is (max batch, max tokens, prefill chunk, page size, window support[, window]).
        cache_config = rx.ShapeExpr([*cache_config.values[:4], 0, *cache_config.values[5:]])
    # The first cache's binding is dead now, and the build's dead code elimination removes it; it
    # removes the kernels too once they are no longer exported symbols.
    cache._expr = builder.emit(rx.Call(call.op, [packed_function, cache_config, *args], call.attrs, call.ty_args))
    for kernel in left_out:
        builder.update_func(kernel, builder.get()[kernel].without_attr("global_symbol"))
