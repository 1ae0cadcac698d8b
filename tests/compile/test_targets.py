"""The target rows: what the model and quantization code read of the target being built."""

from __future__ import annotations

from dataclasses import fields

import pytest
import tvm

from kiln.targets import TARGETS, TargetEntry, building

CAPABILITIES = ("cpu_kernels", "converts_halves", "loads_bytes", "narrow_decode_attention")


def capabilities(entry: TargetEntry) -> tuple:
    return tuple(getattr(entry, name) for name in CAPABILITIES)


def test_the_capabilities_are_fields_of_the_row():
    assert set(CAPABILITIES) <= {f.name for f in fields(TargetEntry)}


@pytest.mark.parametrize("name", TARGETS)
def test_a_row_is_found_from_its_tvm_target_with_what_its_kernels_can_do(name):
    with TARGETS[name].target():
        assert capabilities(building()) == capabilities(TARGETS[name])


def test_rows_that_share_a_tvm_target_share_what_their_kernels_can_do():
    by_key = {}
    for entry in TARGETS.values():
        by_key.setdefault(entry.kernels_key(), set()).add(capabilities(entry))
    assert all(len(found) == 1 for found in by_key.values()), by_key


def test_outside_a_target_no_row_is_being_built():
    assert tvm.target.Target.current(allow_none=True) is None
    assert building() is None
