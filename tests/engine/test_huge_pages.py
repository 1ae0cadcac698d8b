"""The native engine's weights in one block on transparent huge pages (kiln/runtime.py HostWeights):
TVM's allocator gave each weight small pages of its own, and decoding, which streams every weight
once a token, ran faster from huge ones."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from numpy._core.multiarray import _set_madvise_hugepage

from kiln.runtime import HUGE_PAGE, TENSOR_ALIGNMENT, HostWeights

WEIGHTS = [
    np.arange(3, dtype=np.uint8),
    np.arange(5 * 7, dtype=np.float16).reshape(5, 7),
    np.arange(3 << 18, dtype=np.uint32).reshape(3, -1),  # 3 MiB
    np.float32(2.5).reshape(()),
    np.arange(1000, dtype=np.int8).reshape(10, 100),
]


def vm_flags_over(start: int, end: int) -> list[list[str]]:
    """The VmFlags of this process's memory mappings that overlap [start, end)."""
    flags, overlapping = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if mapping := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            overlapping = int(mapping[1], 16) < end and start < int(mapping[2], 16)
        elif overlapping and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    return flags


def test_weights_lie_in_order_in_one_block_that_starts_on_a_huge_page():
    host = HostWeights(w.nbytes for w in WEIGHTS)
    tensors = [host.tensor(w) for w in WEIGHTS]
    base = host.block.ctypes.data
    assert base % HUGE_PAGE == 0
    offset = 0
    for weight, tensor in zip(WEIGHTS, tensors):
        assert tensor.data_ptr() == base + offset
        assert tensor.shape == weight.shape and tensor.dtype == str(weight.dtype)
        assert np.array_equal(tensor.numpy(), weight)
        offset += -(-weight.nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    assert offset == host.block.nbytes


def test_the_tensors_hold_the_block_when_nothing_else_does():
    tensors = [HostWeights(w.nbytes for w in WEIGHTS).tensor(w) for w in WEIGHTS]
    scribble = np.full(4 << 20, 255, np.uint8)  # memory freed early would be handed out again here
    assert all(np.array_equal(t.numpy(), w) for t, w in zip(tensors, WEIGHTS)) and scribble.all()


@pytest.fixture
def numpy_on_small_pages():
    """numpy's own advice for arrays from 4 MB up would mark the block too, so it is off here."""
    was = _set_madvise_hugepage(False)
    yield
    _set_madvise_hugepage(was)


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="this system has no transparent huge pages"
)
def test_the_block_asks_linux_for_huge_pages_before_its_first_write(numpy_on_small_pages):
    """Whether Linux then gives them depends on its free memory (the suite's CI machines gave none at
    times), so what is checked is the advice: every mapping under the block is marked hg."""
    host = HostWeights(w.nbytes for w in WEIGHTS)
    base = host.block.ctypes.data
    flags = vm_flags_over(base, base + host.block.nbytes)
    assert flags and all("hg" in f for f in flags), flags
