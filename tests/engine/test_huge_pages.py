"""The native engine's weights on transparent huge pages (kiln/runtime.py ask_for_huge_pages): TVM's
allocator asks for small pages, and decoding, which streams every weight once a token, ran faster
from huge ones."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tvm

from kiln.runtime import ask_for_huge_pages

MIB = 1 << 20


def huge_page_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of this process's memory mappings that overlap [start, end) (the advice splits
    a mapping where its pages start)."""
    held, overlapping = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if mapping := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            overlapping = int(mapping[1], 16) < end and start < int(mapping[2], 16)
        elif overlapping and line.startswith("AnonHugePages:"):
            held += int(line.split()[1]) * 1024
    return held


def test_a_weight_written_after_the_ask_is_on_huge_pages_where_linux_gives_them():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    weight = np.arange(16 * MIB // 4, dtype=np.float32)
    tensor = tvm.runtime.empty(weight.shape, "float32", tvm.cpu())
    ask_for_huge_pages(tensor, weight.nbytes)
    tensor.copyfrom(weight)
    held = huge_page_bytes_in(tensor.data_ptr(), tensor.data_ptr() + weight.nbytes)
    if "[never]" in thp:
        assert held == 0
    else:  # 16 MiB hold at least six whole, aligned 2 MiB pages wherever they start
        assert held >= 6 * 2 * MIB, (held, thp)
    assert np.array_equal(tensor.numpy(), weight)
