"""Software prefetch for CPU decode GEMVs: a row's weights asked into L1 ahead of the step that reads
them. On its own the hardware streamed matrices larger than the caches at 18–24 GB/s of this Zen 5's
35 on one thread (its prefetchers stop at 4 KB pages); asked 8 KB ahead, one prefetch per cache line
a step takes, 8-bit decode kernels streamed (Q8_0 151936 × 896, Q5_0 116736 × 896, Q4_K and Q6_K
48640 × 1024, GB/s) 24.3 → 32.7, 23.1 → 30.0, 17.9 → 23.3, 19.6 → 38.8 (4 KB: as good on all but
Q6_K; 16 KB: Q5_0 no better than none)."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T
from tvm.target import Target

from kiln.targets import llvm_triple

AHEAD = 8 << 10
CACHE_LINE = 64


def prefetches(target: Target) -> bool:
    """Whether `target` has a prefetch instruction (wasm has none)."""
    return not llvm_triple(target).startswith("wasm")


def prefetch(buffer: tirx.Buffer, *indices) -> tirx.PrimExpr:
    """A hint to bring the cache line of `buffer[indices]` into L1 (past a row's end: the rows after it;
    past the buffer's, an address the CPU ignores)."""
    return T.call_llvm_intrin(
        "void", "llvm.prefetch.p0", T.address_of(buffer[indices]), T.int32(0), T.int32(3), T.int32(1)
    )
