"""Choosing the next token from a row of logits: `Sampler`, the same definition as `Sampler` in
web/src/sampler.js, step for step, so that a seed picks the same tokens natively and in the
browser whenever the logits agree (README, "Chat in the browser").

Penalties first (repetition over prompt and output as in `transformers`, presence and frequency
over the output as in OpenAI's API), then greedy at temperature 0, otherwise temperature, top-k,
top-p and a draw from mulberry32 seeded by `seed`.
"""

from __future__ import annotations

import secrets
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kiln.engine import GenerationConfig

NUCLEUS_FIRST_SLICE = 64
# Sampling at a lower temperature is greedy anyway, and dividing logits by a subnormal one overflows.
GREEDY_BELOW_TEMPERATURE = 1e-5
UINT32 = 0xFFFFFFFF
LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # k × LN2_HI is exact (fdlibm's split)
EXP_UNDERFLOW = -708.0  # below, e^x is subnormal: its weight counts as 0
EXP_TERMS = list(accumulate(range(1, 14), lambda term, n: term / n, initial=1.0))  # 1 / n! for n = 0 … 13


class Sampler:
    """Picks each step's token from its logits, per a GenerationConfig.

    The same definition as `Sampler` in web/src/sampler.js, step for step, so that a seed picks
    the same tokens natively and in the browser whenever the logits agree (README, "Chat in the browser"):
    penalties in float64 (repetition over prompt and output, then presence + frequency × count
    over the output); tokens a response format does not allow next get -inf; greedy (the first
    maximum) below temperature 1e-5; otherwise divide by the temperature, keep the top_k largest
    (ties to the lower id), weigh with `exp_nonpositive`, keep the most likely tokens until their
    weight reaches top_p of the total (ties to the lower id), and draw u from mulberry32: the
    first kept token in id order whose running weight exceeds u × their total. Every sum runs in
    float64 in that stated order. Without a seed, a random one.
    """

    def __init__(self, config: GenerationConfig, prompt_ids: list[int]):
        self.config = config
        self.random = Mulberry32(secrets.randbits(32) if config.seed is None else config.seed)
        self.seen = set(prompt_ids)
        self.output_counts: dict[int, int] = {}

    def record(self, token: int) -> None:
        self.seen.add(token)
        self.output_counts[token] = self.output_counts.get(token, 0) + 1

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        c = self.config
        logits = logits.astype(np.float64)
        if c.repetition_penalty != 1 and self.seen:
            seen = np.fromiter(self.seen, dtype=np.int64)
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / c.repetition_penalty, values * c.repetition_penalty)
        if self.output_counts:
            generated = np.fromiter(self.output_counts, dtype=np.int64)
            counts = np.fromiter(self.output_counts.values(), dtype=np.float64)
            logits[generated] -= c.presence_penalty + c.frequency_penalty * counts
        return logits

    def sample(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """The next token; with `allowed` (a boolean per token id), one of the allowed tokens."""
        c = self.config
        logits = self.penalized(logits)
        if allowed is not None:
            logits[~allowed] = -np.inf
        if c.temperature < GREEDY_BELOW_TEMPERATURE:
            return int(np.argmax(logits))
        scaled = logits / c.temperature
        ids = np.arange(scaled.size)
        if 0 < c.top_k < scaled.size:
            ids = np.sort(ranked(largest(scaled, c.top_k), scaled)[: c.top_k])
        candidates = scaled[ids]
        weights = exp_nonpositive(candidates - candidates.max())
        if c.top_p < 1:
            kept = np.sort(nucleus(candidates, weights, c.top_p))
            ids, weights = ids[kept], weights[kept]
        return int(ids[draw(weights, self.random())])


class Mulberry32:
    """mulberry32 on the seed's low 32 bits, as `seededRandom` in web/src/sampler.js: floats in [0, 1)."""

    def __init__(self, seed: int):
        self.state = seed & UINT32

    def __call__(self) -> float:
        self.state = (self.state + 0x6D2B79F5) & UINT32
        t = self.state
        t = ((t ^ (t >> 15)) * (t | 1)) & UINT32
        t ^= (t + ((t ^ (t >> 7)) * (t | 61))) & UINT32
        return (t ^ (t >> 14)) / 2**32


def exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """e^x for x ≤ 0 from + − × ÷ alone, which IEEE 754 rounds the same in every language: numpy's
    exp and JavaScript's Math.exp differ in the last bit on about 1 argument in 10, and the weights
    must be equal bit for bit on both sides. Taylor's series to x^13 on |r| ≤ ln2 / 2: within an ulp."""
    clipped = np.maximum(x, EXP_UNDERFLOW)
    k = np.floor(clipped * LOG2E + 0.5)
    r = (clipped - k * LN2_HI) - k * LN2_LO
    total = np.full_like(r, EXP_TERMS[-1])
    for term in reversed(EXP_TERMS[:-1]):
        total *= r
        total += term
    return np.where(x < EXP_UNDERFLOW, 0.0, np.ldexp(total, k.astype(np.int32)))


def largest(values: np.ndarray, count: int) -> np.ndarray:
    """Ids of the `count` largest values and of every value equal to the smallest of those, in id
    order (selecting costs less than sorting them all)."""
    kth = np.partition(values, values.size - count)[values.size - count]
    return np.flatnonzero(values >= kth)


def ranked(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`ids` (in id order) from the largest value to the smallest, ties lower id first."""
    return ids[np.argsort(-values[ids], kind="stable")]


def nucleus(scaled: np.ndarray, weights: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the most likely tokens, most likely first (ties lower position first), whose
    weight first reaches top_p of the total. Sorts only a top slice that already holds that weight
    (sorting the whole vocabulary every step costs as much as a decode step)."""
    threshold = top_p * np.cumsum(weights)[-1]
    size = NUCLEUS_FIRST_SLICE
    while True:
        # Past a quarter of the vocabulary, selecting costs more than sorting it all.
        whole = size * 4 >= scaled.size
        top = ranked(np.arange(scaled.size) if whole else largest(scaled, size), scaled)
        cumulative = np.cumsum(weights[top])
        if whole or cumulative[-1] >= threshold:
            return top[: int(np.searchsorted(cumulative, threshold)) + 1]
        size *= 8


def draw(weights: np.ndarray, u: float) -> int:
    """The first position whose running weight exceeds u × the total (the last one if rounding leaves none)."""
    cumulative = np.cumsum(weights)
    return min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), cumulative.size - 1)
