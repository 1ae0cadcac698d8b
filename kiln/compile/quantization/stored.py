"""What a scheme stores for a weight: an array and, when its bytes are not plain values of its
dtype, the tensor-cache record fields that say how to read them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Stored:
    array: np.ndarray
    layout: dict = field(default_factory=dict)
