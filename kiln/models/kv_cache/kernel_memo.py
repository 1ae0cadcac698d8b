"""TVM's paged KV cache, made with each of its kernels written once per process.

TVM writes the cache's kernels in TVMScript and parses each anew whenever a cache is made: some 17
parses, half of a tiny model's compile (most of it in `inspect.stack()`, which the parser calls to
find the kernel's closure). A kernel depends only on its maker's arguments (shapes, dtype, RoPE
settings, the target), and TVM's IR is immutable, so a kernel made once serves every later cache
with the same arguments: a second target of one build, or the next build in the same process.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tvm.relax.frontend.nn.llm import kv_cache
from tvm.target import Target

# The kernel makers TIRPagedKVCache calls, by their names in its module.
KERNEL_MAKERS = (
    "_attention_decode",
    "_attention_decode_cpu",
    "_attention_prefill",
    "_attention_prefill_cpu",
    "_attention_prefill_mla",
    "_attention_prefill_ragged",
    "_attention_prefill_ragged_cpu",
    "_compact_kv_copy",
    "_compact_kv_copy_cpu",
    "_copy_single_page",
    "_copy_single_page_cpu",
    "_copy_single_page_mla",
    "_kv_cache_debug_get_kv",
    "_kv_cache_transpose_append",
    "_kv_cache_transpose_append_mla",
    "_merge_state_inplace",
    "_merge_state_inplace_cpu",
    "llama_rope_with_position_map",
    "tree_attn",
    "tree_attn_cpu",
    "tree_attn_with_paged_kv_cache",
    "tree_attn_with_paged_kv_cache_cpu",
)
_made: dict[tuple, Any] = {}


class Unkeyable(Exception):
    """An argument that names no value: a symbolic variable, whose kernel is made each time."""


def argument_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, Target):
        return ("target", str(value), str(value.host) if value.host else None)
    raise Unkeyable


def made_once(name: str, make: Callable) -> Callable:
    def kernel(*args, **kwargs):
        try:
            key = (name, *map(argument_key, args), *((k, argument_key(v)) for k, v in sorted(kwargs.items())))
        except Unkeyable:
            return make(*args, **kwargs)
        if key not in _made:
            _made[key] = make(*args, **kwargs)
        return _made[key]

    return kernel


@contextmanager
def kernels_made_once() -> Iterator[None]:
    """Within: TIRPagedKVCache takes each kernel it was given before with the same arguments."""
    makers = {name: getattr(kv_cache, name) for name in KERNEL_MAKERS}
    for name, make in makers.items():
        setattr(kv_cache, name, made_once(name, make))
    try:
        yield
    finally:
        for name, make in makers.items():
            setattr(kv_cache, name, make)
