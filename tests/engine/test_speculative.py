"""Speculative decoding in the native engine (kiln/speculative.py): prompt lookup and a draft model
give plain decoding's tokens, stops and lengths, leave the cache as a fresh prefill would, keep a
response format, and sample what plain sampling does seed for seed."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from kiln.engine import Engine, GenerationConfig
from kiln.errors import KilnError
from kiln.runtime import NativeModel
from kiln.speculative import PassCosts, PromptLookup, Speculation, check_same_vocabulary
from kiln.structured import ResponseFormat

from helpers.simulated_reply import simulated_reply
from helpers.web import run_kiln

PROMPT_LOOKUP = Speculation("prompt-lookup")
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
PROMPTS = ["The history of the", "Once upon a time", "1, 2, 3, 4, 5, 6, 7", "the cat sat on the mat. the cat sat on"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_build) -> Path:
    return tiny_build("q0f32")


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Engine:
    return Engine(tiny_dir, speculation=PROMPT_LOOKUP)


@pytest.fixture(scope="module")
def verifying_engine(tiny_build) -> Engine:
    """The tiny Llama at 4 bits, whose library's verify functions run the passes of up to 5 tokens."""
    return Engine(tiny_build("q4f32_1"), speculation=PROMPT_LOOKUP)


@pytest.fixture(scope="module")
def drafted(tiny_dir, tiny_build) -> Engine:
    """The tiny Llama drafted by its own 4-bit build (one tokenizer, close but not equal logits: a
    random model's are near ties everywhere, so its proposals are often wrong)."""
    return Engine(tiny_dir, speculation=Speculation("draft", tiny_build("q4f32_1")))


@pytest.fixture(scope="module")
def self_drafted(tiny_dir) -> Engine:
    """The tiny Llama drafted by its own library: proposals the model takes."""
    return Engine(tiny_dir, speculation=Speculation("draft", tiny_dir))


def run(engine: Engine, prompt, mode: str | None, **config):
    engine.reset()
    return engine.generate(prompt, GenerationConfig(speculative=mode, **{"max_tokens": 48, **config}))


def echoing_prompt(engine: Engine, prompt: str) -> list[int]:
    """The prompt, its greedy reply, then the prompt again: the proposer guesses that reply after it,
    which the model may follow all the way, part of the way or not at all."""
    ids = engine.encode(prompt)
    return ids + run(engine, ids, "off").tokens + ids[1:]


# The proposer


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(Speculation("prompt-lookup", ngram_min=1, ngram_max=3), [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 2, 3])
    assert lookup.propose(4) == [7, 8, 2, 3]  # "2 3" last came before 7 (the 3-gram "8 2 3" never came)
    lookup.extend([7])
    assert lookup.propose(2) == [8, 2]  # "2 3 7"
    lookup.extend([5])
    assert lookup.propose(3) == []  # 5 never came before
    assert PromptLookup(Speculation("prompt-lookup"), [4, 4]).propose(3) == []  # too short for a 2-gram with a follower


def decode_runs(steps: list[int]) -> list[int]:
    """The lengths of the runs of decode steps (-1) between passes."""
    return [len(list(run)) for decoding, run in itertools.groupby(steps, key=lambda step: step < 0) if decoding]


def test_passes_that_lose_pause_so_a_reply_loses_less_than_the_loss_share():
    """Proposals that are always wrong (a draft that always proposes: no decode step ever comes by
    itself to judge passes by) at the cost of a CPU's verify pass (4 decode steps): the first loss
    pauses for the 30 decode steps of which its 3 lost steps are the loss share, each one after it
    twice as long, up to MAX_PAUSE."""
    tokens = 2000
    time, steps = simulated_reply(PassCosts(), tokens, pass_steps=4.0, accepted=[0])
    assert steps[:2] == [0, -1]  # the first pass, then a decode step to judge passes by
    assert decode_runs(steps)[:7] == [1, 30, 60, 120, 240, PassCosts.MAX_PAUSE, PassCosts.MAX_PAUSE]
    assert tokens / time >= 1 / (1 + PassCosts.LOSS_SHARE / 4)
    time, steps = simulated_reply(PassCosts(), tokens, pass_steps=2.0, accepted=[3])
    assert steps.count(-1) == 1 and tokens / time > 1.9  # passes that pay never pause


def test_a_pass_that_saves_time_ends_a_run_of_losses():
    """Passes of 2 decode steps taking 0, 0, 0 and 3 tokens in turn (the first is judged by none: a
    decode step follows it). A loss pauses 10 steps (its lost step is the loss share of them), the
    next 20; the pass taking 3 saves 2 steps, and the losses after it pause 10 and 20 again (the
    first of them outweighed by that saving)."""
    _, steps = simulated_reply(PassCosts(), 200, pass_steps=2.0, accepted=[0, 0, 0, 3])
    assert [step for step in steps if step >= 0][:8] == [0, 0, 0, 3, 0, 0, 0, 3]
    assert decode_runs(steps)[:5] == [1, 10, 20, 10, 20]


def test_speculation_parses_the_cli_methods(tmp_path):
    assert Speculation.parse("prompt-lookup") == PROMPT_LOOKUP
    assert Speculation.parse(f"draft:{tmp_path}") == Speculation("draft", tmp_path)
    assert Speculation.parse("off") is None
    with pytest.raises(KilnError, match="prompt-lookup, draft:MODEL_DIR or off"):
        Speculation.parse("draft:")


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    ours = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    theirs = Tokenizer(models.WordLevel({"a": 0, "c": 1, "<unk>": 2}, unk_token="<unk>"))
    check_same_vocabulary(ours, ours, tmp_path)
    with pytest.raises(KilnError, match=r"'b' is not a token in the draft and token 1 in the target"):
        check_same_vocabulary(ours, theirs, tmp_path)


# Greedy: plain decoding's tokens


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("echoed", [False, True])
@pytest.mark.parametrize("through_verify_functions", [False, True])
def test_prompt_lookup_greedy_is_plain_greedy(engine, verifying_engine, through_verify_functions, prompt, echoed):
    speculating = verifying_engine if through_verify_functions else engine
    ids = echoing_prompt(speculating, prompt) if echoed else speculating.encode(prompt)
    plain, fast = run(speculating, ids, "off"), run(speculating, ids, None)
    assert fast.tokens == plain.tokens
    assert fast.usage.proposed_tokens > 0
    assert fast.usage.model_steps == plain.usage.model_steps - fast.usage.accepted_tokens


def test_proposals_are_right_wrong_and_partly_right(engine):
    prompts = [*PROMPTS, *(echoing_prompt(engine, prompt) for prompt in PROMPTS)]
    usages = [run(engine, prompt, None).usage for prompt in prompts]
    assert any(u.accepted_tokens == u.proposed_tokens > 0 for u in usages)  # right all the way
    assert any(0 < u.accepted_tokens < u.proposed_tokens for u in usages)  # partly right
    assert any(u.accepted_tokens == 0 < u.proposed_tokens for u in usages)  # wrong


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_draft_model_greedy_is_plain_greedy(drafted, self_drafted, prompt):
    plain, fast = run(drafted, prompt, "off"), run(drafted, prompt, None)
    assert fast.tokens == plain.tokens
    # How many of a wrong draft's proposals are tried depends on what passes cost (PassCosts), not so
    # for one that is always right.
    fast = run(self_drafted, prompt, None)
    assert fast.tokens == plain.tokens
    assert fast.usage.accepted_tokens > 0
    assert fast.usage.model_steps < plain.usage.model_steps


def test_stops_and_lengths_land_where_plain_decoding_puts_them(engine):
    ids = echoing_prompt(engine, PROMPTS[0])
    plain = run(engine, ids, "off")
    for max_tokens in (1, 2, 5, 17, 48):
        fast = run(engine, ids, None, max_tokens=max_tokens)
        assert (fast.tokens, fast.finish_reason) == (plain.tokens[:max_tokens], "length")
    for stop in (plain.text[3:9], plain.text[-5:]):
        plain_stopped, fast = run(engine, ids, "off", stop=[stop]), run(engine, ids, None, stop=[stop])
        assert (fast.text, fast.tokens, fast.finish_reason) == (plain_stopped.text, plain_stopped.tokens, "stop")


def test_rollback_leaves_the_cache_as_a_fresh_prefill_would(engine, tiny_dir):
    ids = echoing_prompt(engine, PROMPTS[3])
    result = run(engine, ids, None, max_tokens=30)
    assert result.usage.proposed_tokens > result.usage.accepted_tokens  # some proposals were rolled back
    held = engine.model.cached_tokens
    assert held == len(ids) + len(result.tokens) - 1  # the last token was never run
    after = engine.model.decode(result.tokens[-1])
    fresh = NativeModel(tiny_dir)
    expected = fresh.prefill(ids + result.tokens)
    np.testing.assert_allclose(after, expected, atol=2e-4)


def test_libraries_whose_decode_matmuls_take_a_few_rows_get_verify_functions(tiny_build, mixed_build):
    """Factored decode matmuls (4-bit groups, GGUF blocks) run a few rows for little more than one;
    float weights and 8-bit activations run them through prefill's matmuls, as prefill_all_logits."""
    assert NativeModel(tiny_build("q4f32_1")).verify_rows == [3, 5]
    assert NativeModel(mixed_build("gguf_f32")).verify_rows == [3, 5]
    assert NativeModel(tiny_build("q0f32")).verify_rows == []
    assert NativeModel(tiny_build("q8_0_i8")).verify_rows == []


def test_a_verify_pass_gives_prefill_all_logits_rows_and_caches_only_its_tokens(tiny_build):
    """A float32 CPU library's verify functions (3 and 5 rows) take passes of up to 5 tokens, padded
    to the next of their row counts; longer ones, and a library without them, run prefill_all_logits."""
    verifying, plain = NativeModel(tiny_build("q4f32_1")), NativeModel(tiny_build("q4f32_1"))
    assert verifying.verify_rows == [3, 5]
    plain.verify_rows = []
    prompt = list(range(5, 40))
    for model in (verifying, plain):
        model.prefill(prompt)
    assert verifying.speculation_room() == 5
    for count in range(1, 8):
        ids = list(range(50, 50 + count))
        rows, expected = verifying.all_logits(ids), plain.all_logits(ids)
        assert verifying.cached_tokens == plain.cached_tokens == len(prompt) + count
        np.testing.assert_allclose(rows, expected, atol=1e-4)
        np.testing.assert_allclose(verifying.decode(7), plain.decode(7), atol=1e-4)  # the padding left no trace
        for model in (verifying, plain):
            model.rollback(count + 1)


@pytest.mark.parametrize(
    "prompt, response_format",
    [
        ("The answer is yes. The answer is no. The answer is", ResponseFormat.from_grammar(YES_NO)),
        ('{"answer": "yes"} {"answer": "no"} {"answer": "', ResponseFormat.from_schema(json.dumps(ANSWER))),
    ],
)
def test_a_response_format_holds_with_speculation(engine, prompt, response_format):
    plain = run(engine, prompt, "off", response_format=response_format, max_tokens=256)
    fast = run(engine, prompt, None, response_format=response_format, max_tokens=256)
    assert fast.tokens == plain.tokens
    assert fast.finish_reason == "stop"
    assert fast.usage.proposed_tokens > 0
    if response_format.kind == "grammar":
        assert fast.text in ("The answer is yes.", "The answer is no.")
    else:
        assert json.loads(fast.text)["answer"] in ("yes", "no")


# Sampling: the model's distribution, the same draws


def test_sampling_gives_plain_samplings_tokens_seed_for_seed(engine):
    ids = echoing_prompt(engine, PROMPTS[3])
    config = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 12}
    for seed in range(40):
        plain, fast = run(engine, ids, "off", seed=seed, **config), run(engine, ids, None, seed=seed, **config)
        assert fast.tokens == plain.tokens, seed


def test_sampled_tokens_follow_the_models_distribution(engine):
    """Chi-square of the second token's counts over 600 seeds, after the most frequent first one,
    against the model's own probabilities there: the second comes from a verify pass's row whenever
    the first was proposed. Bins expected to hold fewer than 5 are pooled; the threshold is the
    99.9th percentile of chi-square (Wilson–Hilferty)."""
    ids = echoing_prompt(engine, PROMPTS[3])
    temperature = 0.5
    pairs = [
        tuple(run(engine, ids, None, seed=seed, temperature=temperature, max_tokens=2).tokens) for seed in range(600)
    ]
    firsts = [first for first, _ in pairs]
    first = max(set(firsts), key=firsts.count)
    seconds = np.array([second for f, second in pairs if f == first])
    logits = NativeModel(engine.model_dir).prefill(ids + [first]).astype(np.float64) / temperature
    probabilities = np.exp(logits - logits.max())
    expected = probabilities / probabilities.sum() * seconds.size
    observed = np.bincount(seconds, minlength=expected.size).astype(np.float64)
    bins = expected >= 5
    observed = np.append(observed[bins], observed[~bins].sum())
    expected = np.append(expected[bins], expected[~bins].sum())
    chi_square = float(((observed - expected) ** 2 / np.maximum(expected, 1e-12)).sum())
    degrees = int(bins.sum())
    assert degrees >= 2, "the distribution is too peaked to test"
    threshold = degrees * (1 - 2 / (9 * degrees) + 3.09 * (2 / (9 * degrees)) ** 0.5) ** 3
    assert chi_square < threshold, (chi_square, threshold)


# Surfaces


def test_a_request_may_turn_speculation_off_or_on(engine, tiny_dir):
    plain_engine = Engine(tiny_dir)
    assert run(plain_engine, PROMPTS[3], "prompt-lookup").usage.proposed_tokens > 0
    assert run(engine, PROMPTS[3], "off").usage.proposed_tokens == 0
    with pytest.raises(KilnError, match="loaded a draft model"):
        run(engine, PROMPTS[3], "draft")
    with pytest.raises(KilnError, match="speculative must be one of"):
        run(engine, PROMPTS[3], "sometimes")


def test_kiln_generate_speculative_prints_the_plain_reply(engine, tiny_dir):
    args = ("generate", str(tiny_dir), "-p", PROMPTS[3], "--max-tokens", "24", "--json")
    fast = run_kiln(*args, "--speculative", "prompt-lookup")
    assert fast.returncode == 0, fast.stderr
    result = json.loads(fast.stdout)
    assert result["tokens"] == run(engine, PROMPTS[3], "off", max_tokens=24).tokens
    assert result["usage"]["proposed_tokens"] > 0
    bad = run_kiln(*args, "--speculative", "guess")
    assert bad.returncode != 0 and "prompt-lookup, draft:MODEL_DIR or off" in bad.stderr


def test_engine_config_speculative_is_checked():
    with pytest.raises(KilnError, match="speculative must be one of"):
        replace(GenerationConfig(), speculative="maybe").check()
