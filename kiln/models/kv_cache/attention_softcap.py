"""An attention-logit soft-cap (Gemma 2: scores become cap · tanh(score / cap) before the softmax)
in TVM's paged KV cache attention kernels, which have no such option.

Each attention kernel the cache adds to the module is rewritten (tvm_ffi's structural map): the one
statement that stores a finished query·key score gets its value wrapped in the cap. The kernels'
scores are already scaled by sm_scale · log2(e) for their exp2 softmax, so the cap is scaled the
same way. A masked score is stored by another statement and stays masked. A kernel where the
statement is not found exactly once (another TVM version) stops the build instead of running
uncapped.
"""

from __future__ import annotations

import math
import re

import tvm_ffi
from tvm import tirx

from kiln.errors import KilnError

from .cache_kernels import replace_cache_kernels

LOG2E = r"T\.float32\(1\.44269504\d*\)"
# The statements that store a finished score, as TVM 0.27 prints them: the CPU kernels' (TVM's
# paged, ragged and decode ones; Kiln's, per key of a block) and the GPU kernels' (tiled prefill,
# decode after its cross-thread sum).
SCORE_STORES = re.compile(
    rf"S_val\[(0|j)\] = S_val\[(0|j)\] \* \(sm_scale \* {LOG2E}\)"
    rf"|attention_score\[0\] = result\[0\] \* {LOG2E} \* sm_scale"
    r"|S_smem\[i, j\] = S_local\[i, j\]"
    r"|S_local\[j\] = t0\[0\]"
)


def is_attention_kernel(name: str) -> bool:
    return name.startswith("tir_attention_") and "merge_state" not in name


def soft_capped(kernel: tirx.PrimFunc, name: str, cap: float) -> tirx.PrimFunc:
    scaled_cap = cap * math.log2(math.e)
    capped = []

    def cap_score(store: tirx.BufferStore) -> tirx.BufferStore:
        if not SCORE_STORES.fullmatch(str(store).splitlines()[-1]):  # (earlier lines declare its variables)
            return store
        capped.append(store)
        value = tirx.const(scaled_cap, "float32") * tirx.tanh(store.value * tirx.const(1 / scaled_cap, "float32"))
        return tirx.BufferStore(store.buffer, value, store.indices)

    rewritten = tvm_ffi.structural_map(kernel, (tirx.BufferStore, cap_score))
    if len(capped) != 1:
        raise KilnError(
            f"TVM's attention kernel {name} stores its scores in {len(capped)} places Kiln knows, not one: "
            "Kiln cannot give this TVM's kernels an attention soft-cap"
        )
    return rewritten


def soft_cap_attention_kernels(cap: float) -> None:
    """Replace, in the module being built, every attention kernel the KV cache added."""
    replace_cache_kernels(lambda name, kernel: soft_capped(kernel, name, cap) if is_attention_kernel(name) else None)
