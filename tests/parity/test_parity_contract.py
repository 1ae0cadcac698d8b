"""The parity contract itself, on synthetic logits: every branch of `judge_prompt` and
`check_contract` (a near tie, a flip to a token that is not the runner-up, a real divergence,
NaN and infinity, one bad prompt among good ones, the forced window after a divergence)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.app_config import BUILD_RECORD
from kiln.browser.parity import ParityContract, check_contract, judge_prompt
from kiln.compile.quantization.gguf_blocks import INT8_LOGIT_TOLERANCE, INT8_NEAR_TIE

CONTRACT = ParityContract()
VOCAB = 8
PROMPT_IDS = [1, 2, 3, 4]


def step(token: int, runner_up: int | None = None, gap: float = 1.0) -> np.ndarray:
    """Logits whose argmax is `token`, `gap` above `runner_up`, the rest far below."""
    logits = np.linspace(-5.0, -4.0, VOCAB, dtype=np.float32)
    logits[(token + 1) % VOCAB if runner_up is None else runner_up] = 1.0
    logits[token] = 1.0 + gap
    return logits


class Runs:
    """A prompt's native and browser logits, identical until a test changes them: greedy steps
    choose tokens 5, 6, 7, 0, …; the forced rows are the prompt's rows then the greedy steps."""

    def __init__(self, steps: int = 6):
        self.native_steps = [step((5 + k) % VOCAB) for k in range(steps)]
        prompt_rows = [step(token) for token in PROMPT_IDS[1:]]
        self.native_rows = np.stack(prompt_rows + self.native_steps)
        self.browser_steps = [s.copy() for s in self.native_steps]
        self.browser_rows = self.native_rows.copy()
        self.browser_prompt_ids = list(PROMPT_IDS)

    def row_of_step(self, k: int) -> int:
        return len(PROMPT_IDS) - 1 + k

    def diverge(self, k: int, logits: np.ndarray) -> None:
        """The browser's greedy step `k` (and its forced row) gets `logits`; its greedy decoding
        stops there, as `greedy(…, stop_at=…)` does."""
        self.browser_steps = self.browser_steps[:k] + [logits]
        self.browser_rows[self.row_of_step(k)] = logits

    def judge(self, forced_positions: int | None = None):
        return judge_prompt(
            "prompt",
            PROMPT_IDS,
            self.browser_prompt_ids,
            self.native_steps,
            self.browser_steps,
            self.native_rows,
            self.browser_rows,
            forced_positions,
        )


def test_identical_runs_pass_and_compare_every_forced_position():
    result = Runs().judge()
    assert result.failures(CONTRACT) == []
    assert result.greedy_flip is None and result.forced_flips == []
    assert result.forced_positions == len(PROMPT_IDS) - 1 + 6 == len(PROMPT_IDS + [5, 6, 7, 0, 1])
    assert result.forced_agreement(CONTRACT) == 1.0


def test_a_near_tie_flipped_to_the_native_runner_up_is_reported_not_failed():
    runs = Runs()
    runs.native_steps[2] = step(7, runner_up=3, gap=5e-4)
    runs.native_rows[runs.row_of_step(2)] = runs.native_steps[2]
    runs.diverge(2, step(3, runner_up=7, gap=1e-4))
    result = runs.judge()
    assert result.first_divergence == 2 and result.greedy_flip.near_tie(CONTRACT)
    assert result.forced_near_ties(CONTRACT) == 1 and result.forced_agreement(CONTRACT) == 1.0
    assert result.failures(CONTRACT) == []
    assert result.to_json(CONTRACT)["greedy_ok"] and not result.to_json(CONTRACT)["greedy_identical"]


def test_a_near_tie_flipped_to_a_token_that_is_not_the_runner_up_fails():
    runs = Runs()
    runs.native_steps[2] = step(7, runner_up=3, gap=5e-4)
    runs.native_rows[runs.row_of_step(2)] = runs.native_steps[2]
    runs.diverge(2, step(1))
    [greedy, forced] = runs.judge().failures(CONTRACT)
    assert "greedy tokens diverge at step 2 without a near tie" in greedy and "browser 1" in greedy
    assert "forced-decoding top-1 agreement" in forced


def test_a_real_divergence_fails():
    runs = Runs()
    runs.diverge(3, step(2))  # the native gap there is 1.0
    failures = runs.judge().failures(CONTRACT)
    assert any(
        "greedy tokens diverge at step 3 without a near tie: native 0 (top-2 gap 1.00e+00" in f for f in failures
    )


def test_one_forced_flip_fails_a_prompt_and_a_near_tie_flip_does_not():
    runs = Runs()
    runs.browser_rows[1] = step(6)  # a prompt position; the native row predicts 3 with gap 1.0
    [failure] = runs.judge().failures(CONTRACT)
    assert failure.startswith("forced-decoding top-1 agreement 88.9% (< 99%), first at position 1: native 3")

    runs.native_rows[1] = step(3, runner_up=6, gap=2e-4)
    result = runs.judge()
    assert result.failures(CONTRACT) == [] and result.forced_near_ties(CONTRACT) == 1


@pytest.mark.parametrize("where", ["native_steps", "browser_steps", "native_rows", "browser_rows"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_nan_or_an_infinity_anywhere_fails(where, value):
    runs = Runs()
    logits = getattr(runs, where)
    logits[-1][2] = value  # not at the argmax: every token choice is unchanged
    failures = runs.judge().failures(CONTRACT)
    name = where.replace("_steps", "_greedy").replace("_rows", "_forced")
    assert failures and failures[0] == f"non-finite logits (NaN or infinity) in {name}"


def test_nan_last_token_logits_do_not_pass_the_tolerance():
    runs = Runs()
    runs.browser_steps[0] = np.full(VOCAB, np.nan, dtype=np.float32)
    runs.browser_steps[0][5] = 0.0
    failures = runs.judge().failures(CONTRACT)
    assert any(f.startswith("last-token logits differ by nan") for f in failures)


def test_last_token_logits_over_the_tolerance_fail():
    runs = Runs()
    runs.browser_steps[0] = runs.browser_steps[0] + np.float32(0.02)
    assert runs.judge().failures(CONTRACT) == ["last-token logits differ by 2.00e-02 (> 0.01)"]


@pytest.mark.parametrize(("quantization", "int8"), [("gguf_i8", True), ("gguf_f32", False), ("q4f32_1", False)])
def test_a_model_on_8_bit_activations_is_held_to_their_stated_tolerance(tmp_path, quantization, int8):
    (tmp_path / BUILD_RECORD).write_text(json.dumps({"quantization": quantization}))
    contract = ParityContract.of(tmp_path)
    if not int8:
        assert contract == CONTRACT
        return
    assert contract.near_tie_gap == INT8_NEAR_TIE and contract.max_last_logit_rel_diff == INT8_LOGIT_TOLERANCE
    runs = Runs()  # the largest native logit after the prompt is -5.0 in magnitude: 1.25 allowed
    runs.browser_steps[0] = runs.browser_steps[0] + np.float32(1.2)
    assert runs.judge().failures(contract) == []
    runs.browser_steps[0] = runs.browser_steps[0] + np.float32(0.1)
    assert runs.judge().failures(contract) == ["last-token logits differ by 1.30e+00 (> 1.25)"]


def test_other_prompt_ids_in_the_browser_fail():
    runs = Runs()
    runs.browser_prompt_ids = [1, 2, 3]
    assert runs.judge().failures(CONTRACT) == ["the browser's tokenizer gives other ids for the prompt"]


def test_the_forced_window_reaches_back_to_a_greedy_divergence():
    runs = Runs(steps=8)
    runs.native_steps[1] = step(6, runner_up=2, gap=5e-4)
    runs.native_rows[runs.row_of_step(1)] = runs.native_steps[1]
    runs.diverge(1, step(2, runner_up=6, gap=1e-4))
    runs.browser_rows[runs.row_of_step(3)] = step(4)  # after the divergence, before the last 2 positions
    result = runs.judge(forced_positions=2)
    assert result.forced_start == runs.row_of_step(1)
    assert [flip.position for flip in result.forced_flips] == [runs.row_of_step(1), runs.row_of_step(3)]
    assert any("forced-decoding top-1 agreement" in f for f in result.failures(CONTRACT))

    without_divergence = Runs(steps=8).judge(forced_positions=2)
    assert (without_divergence.forced_start, without_divergence.forced_positions) == (len(PROMPT_IDS) - 1 + 6, 2)


def test_one_bad_prompt_among_good_ones_fails_by_itself():
    good = Runs().judge()
    bad = Runs()
    bad.browser_rows[2] = step(0)
    failures = check_contract([good, good, bad.judge(), good], CONTRACT)
    assert len(failures) == 1 and failures[0].startswith("prompt 3: forced-decoding top-1 agreement 88.9%")
