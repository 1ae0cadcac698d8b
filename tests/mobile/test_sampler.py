"""The mobile runtime's sampler (kiln/mobile/runtime/sampler.cc) is `kiln.sampling.Sampler`: for
generated rows of logits (ties, -inf, huge and tiny values, vocabularies of 1 to 5000 tokens),
configs and seeds, it picks the same tokens step after step; its e^x and its mulberry32 equal
Python's bit for bit."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers.host_cpp import DriverProcess, host_program

from kiln.engine import GenerationConfig
from kiln.sampling import Mulberry32, Sampler, exp_nonpositive

# Values a row of a few tokens is made of: ties, both zeros, -inf, float32's extremes.
SPECIAL_LOGITS = [0.0, -0.0, 1.0, -1.0, 2.5, 2.5, -np.inf, 3.4e38, -3.4e38, 1e-38, -1e-45, 80.0, -80.0]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    driver = DriverProcess(host_program("sample.cc", ["sampler.cc"], tmp_path_factory.mktemp("sampler")))
    yield driver
    driver.close()


@st.composite
def few_logits(draw) -> np.ndarray:
    values = st.sampled_from(SPECIAL_LOGITS) | st.floats(width=32, allow_nan=False, allow_infinity=False)
    return np.array(draw(st.lists(values, min_size=1, max_size=70)), dtype=np.float32)


@st.composite
def many_logits(draw) -> np.ndarray:
    """A larger row from numpy: near-uniform rows make top_p rank more than its first slice of 64."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="row seed"))
    size = draw(st.integers(71, 5000), label="vocabulary")
    row = rng.normal(size=size) * draw(st.sampled_from([0.01, 1.0, 8.0, 1e30]), label="scale")
    if draw(st.booleans(), label="ties"):
        row = np.round(row)
    row[rng.random(size) < draw(st.sampled_from([0.0, 0.1, 0.9]), label="share at -inf")] = -np.inf
    return row.astype(np.float32)


@st.composite
def requests(draw) -> dict:
    logits = draw(few_logits() | many_logits())
    size = logits.size
    mask = draw(st.sampled_from([None, 0.9, 0.01]), label="allowed share")
    allowed = None if mask is None else np.random.default_rng(size).random(size) < mask
    return {
        "logits": logits,
        "config": {
            "temperature": draw(st.sampled_from([0.0, 1e-6, 1e-5, 0.7, 1.5])),
            "top_p": draw(st.sampled_from([1.0, 0.9, 0.3])),
            "top_k": draw(st.sampled_from([0, 1, 40, size])),
            "repetition_penalty": draw(st.sampled_from([1.0, 1.3, 0.7])),
            "presence_penalty": draw(st.sampled_from([0.0, 0.5, -0.25])),
            "frequency_penalty": draw(st.sampled_from([0.0, 0.3, 2.0])),
            "seed": draw(st.integers(0, 2**53)),
        },
        "prompt_ids": draw(st.lists(st.integers(0, size - 1), max_size=8)),
        "allowed": allowed,
        "steps": draw(st.integers(1, 6)),
        "record": draw(st.booleans()),
    }


def python_tokens(request: dict) -> list[int]:
    sampler = Sampler(GenerationConfig(**request["config"]), request["prompt_ids"])
    tokens = []
    # A row with no finite logit left gives NaN weights, as it does in C++.
    with np.errstate(invalid="ignore"):
        for _ in range(request["steps"]):
            tokens.append(sampler.sample(request["logits"], request["allowed"]))
            if request["record"]:
                sampler.record(tokens[-1])
    return tokens


def as_json(request: dict) -> dict:
    fields = {**request, "logits": request["logits"].tolist()}
    if request["allowed"] is None:
        del fields["allowed"]
    else:
        fields["allowed"] = request["allowed"].tolist()
    return fields


def sampled(logits: np.ndarray, **config) -> dict:
    """A request to sample `logits` 3 times at temperature 1.5, recording each token."""
    fields = {"logits": logits, "config": {"temperature": 1.5, "seed": 7, **config}, "prompt_ids": [], "allowed": None}
    return {**fields, "steps": 3, "record": True}


NEAR_FLAT = np.random.default_rng(0).normal(size=5000).astype(np.float32) * np.float32(0.01)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests())
# top_p's ranking outgrows its first slices (64, then 512 tokens) and ends with the whole row.
@example(request=sampled(NEAR_FLAT, top_p=0.3))
@example(request=sampled(np.zeros(4000, np.float32), top_p=0.9))
# No finite logit: NaN weights, the last token without top_p, the first with it, as numpy gives.
@example(request=sampled(np.full(300, -np.inf, np.float32), top_p=0.3))
@example(request=sampled(np.full(300, -np.inf, np.float32)))
def test_the_tokens_are_pythons(driver, request):
    assert driver.ask(as_json(request))["tokens"] == python_tokens(request)


def test_without_a_seed_each_sampler_draws_its_own(driver):
    request = {"logits": [0.0] * 1000, "config": {"temperature": 1.0}, "prompt_ids": [], "steps": 20, "record": False}
    first, second = (driver.ask(request)["tokens"] for _ in range(2))
    assert first != second and all(0 <= token < 1000 for token in first + second)


def test_the_weights_are_pythons_bit_for_bit(driver):
    x = np.concatenate(
        [
            [0.0, -0.0, -1e-300, -5e-324, -707.9, -708.0, -708.1, -745.2, -1e308, -np.inf],
            -np.random.default_rng(3).exponential(20, 20000),
            -np.random.default_rng(4).uniform(0, 1e-3, 2000),
        ]
    )
    ours = [float.fromhex(value) for value in driver.ask({"exp": [value.hex() for value in x]})["exp"]]
    np.testing.assert_array_equal(np.array(ours).view(np.uint64), exp_nonpositive(x).view(np.uint64))


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31, 2**32 - 1, 2**32 + 7, 2**53 - 1])
def test_the_random_stream_is_pythons(driver, seed):
    python = Mulberry32(seed)
    ours = driver.ask({"random": {"seed": seed, "count": 50}})["random"]
    assert [float.fromhex(value) for value in ours] == [python() for _ in range(50)]
