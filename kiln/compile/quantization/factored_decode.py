"""Decode matmuls on CPUs with each group's scale and offset taken out of the loop over weights.

A group-quantized weight is `level × scale (+ offset)`, the scale and offset shared by a group
of weights. With one input row (decode) the matmul regroups as

    y[o] = Σ_g scale[o, g] · Σ_{j in g} level[o, j] · x[j]  +  offset[o, g] · Σ_{j in g} x[j]

so the loop over a row's weights only unpacks, converts and multiply-adds, and the input's group
sums are computed once for every row. A vector of `LANES` weights is read per step; lane l of
block b meets the same group at every step (`LaneLayout`), so a block ends with one vector of
lane dots per row, scaled into the row's partial sums.

Only float32 weights are factored: a float16 model's weights are rounded to float16 before the
products (by its GPU kernels, by MLC, by the reference it is tested against), which a factored
sum would skip; its decode dequantizes each weight as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from tvm import te, tirx
from tvm.ir.expr import ExprWithOp as PrimExpr

from kiln.models.stage_names import LANE_DOTS, MATMUL
from kiln.targets import building

LANES = 8
# The most input rows a factored matmul takes: a verify pass's (speculative decoding), whose rows
# meet each unpacked vector of weights while it is in registers.
MOST_ROWS = 8


def f32(value: float) -> PrimExpr:
    return tirx.const(value, "float32")


# (row, column) → the weight's level; (row, group) → its group's scale or offset
LevelOf = Callable[[PrimExpr, PrimExpr], PrimExpr]
GroupValue = Callable[[PrimExpr, PrimExpr], PrimExpr]


@dataclass(frozen=True)
class LaneLayout:
    """Which column lane `l` reads at step `t` of block `b` (`column`), and its group (`group`,
    the same at every step of a block)."""

    block_columns: int
    steps: int
    column: Callable[[PrimExpr, PrimExpr, PrimExpr], PrimExpr]
    group: Callable[[PrimExpr, PrimExpr], PrimExpr]
    # Blocks run as one unrolled body, so that where a weight's bits lie in its stored block (a
    # K-quant's 256 weights, 8 or 16 groups) is a constant, not arithmetic on the block's index.
    unrolled_blocks: int = 1


def consecutive_lanes(group_size: int, stored_block: int | None = None) -> LaneLayout:
    """A block is a group; each step reads `LANES` consecutive weights (GGUF's blocks keep
    consecutive weights in consecutive bytes, or in the same nibble of consecutive bytes). The
    groups of a `stored_block` of weights are unrolled together."""
    return LaneLayout(
        group_size,
        group_size // LANES,
        lambda block, step, lane: block * group_size + step * LANES + lane,
        lambda block, lane: block,
        (stored_block or group_size) // group_size,
    )


def word_per_lane(values_per_word: int, group_size: int) -> LaneLayout:
    """Lane l reads word l of a run of `LANES` words, step t the t-th value of each: a step is one
    shift of the same loaded words (MLC's packed words hold consecutive weights). The input is
    read transposed to match, once for every row."""
    columns = LANES * values_per_word
    return LaneLayout(
        columns,
        values_per_word,
        lambda block, step, lane: block * columns + lane * values_per_word + step,
        lambda block, lane: (block * columns + lane * values_per_word) // group_size,
    )


def applies(x: te.Tensor, in_features: int, layout: LaneLayout, weight_dtype: str) -> bool:
    """A static input of at most `MOST_ROWS` rows of float32 weights, built for a CPU (LLVM) target,
    whole blocks of columns."""
    entry = building()
    rows = [d.value if isinstance(d, tirx.IntImm) else None for d in x.shape[:-1]]
    few_rows = None not in rows and math.prod(rows) <= MOST_ROWS
    on_cpu = entry is not None and entry.cpu_kernels
    return on_cpu and few_rows and weight_dtype == "float32" and in_features % layout.block_columns == 0


def factored_matmul(
    x: te.Tensor,
    level: LevelOf,
    scale: GroupValue,
    offset: GroupValue | None,
    out_features: int,
    layout: LaneLayout,
    zero: float = 0.0,
) -> te.Tensor:
    """y[..., o] = Σ_k x[..., k] · ((level[o, k] − zero) · scale[o, g(k)] + offset[o, g(k)]) for a
    few static rows x. A block's lane dots take the levels as they are stored, one vector of them
    for every input row, and −zero × the input's lane sums (computed once for every weight row) is
    added to them before the scale."""
    *unit, in_features = x.shape
    blocks = int(in_features) // layout.block_columns
    lanes = te.compute(
        (*unit, blocks, layout.steps, LANES),
        lambda *i: x[(*i[:-3], layout.column(*i[-3:]))],
        name="x_lanes",
    )

    def lane_sum(*i):
        step = te.reduce_axis((0, layout.steps), name="step")
        return te.sum(lanes[(*i[:-1], step, i[-1])], axis=step)

    sums = te.compute((*unit, blocks, LANES), lane_sum, name="x_lane_sums")
    if zero:
        zero_dots = te.compute((*unit, blocks, LANES), lambda *i: sums[i] * f32(-zero), name="x_zero_dots")

    def lane_dot(o, block, *row_lane):
        *row, lane = row_lane
        step = te.reduce_axis((0, layout.steps), name="step")
        weight = level(o, layout.column(block, step, lane)).astype("float32")
        return te.sum(weight * lanes[(*row, block, step, lane)], axis=step)

    dots = te.compute((out_features, blocks, *unit, LANES), lane_dot, name=LANE_DOTS)
    unrolled = layout.unrolled_blocks
    axes = [te.reduce_axis((0, blocks // unrolled), name="block")]
    if unrolled > 1:
        axes.append(te.reduce_axis((0, unrolled), name="unrolled_block"))
    lane = te.reduce_axis((0, LANES), name="lane")
    block = axes[0] * unrolled + axes[1] if unrolled > 1 else axes[0]

    def row_sum(*idx):
        *row, o = idx
        group = layout.group(block, lane)
        dot = dots[(o, block, *row, lane)]
        if zero:
            dot = dot + zero_dots[(*row, block, lane)]
        term = scale(o, group) * dot
        if offset is not None:
            term = term + offset(o, group) * sums[(*row, block, lane)]
        return te.sum(term, axis=[*axes, lane])

    return te.compute((*unit, out_features), row_sum, name=MATMUL)
