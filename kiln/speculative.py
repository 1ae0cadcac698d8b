"""Speculative decoding: tokens proposed ahead of the reply, verified by the model in one pass.

A proposer guesses how the reply goes on: `PromptLookup` copies what followed the latest earlier
occurrence of the reply's last tokens (in the prompt or the reply), `DraftModel` asks a small
model with the same tokenizer. `Lookahead` verifies a proposal with one `all_logits` pass over
the last token and the proposed ones, and keeps the rows ahead of the reply: the engine samples
each token from its row as it would from a decode step's, and a row is used only while the
sampled tokens are the proposed ones. At the first other token the rest is rolled back (`popn`)
and the next pass starts from it.

So a proposal never chooses a token: the engine's sampler does, with its own seeded draws, one per
token, as without speculation. For a proposer that proposes one token (q a point mass) this is the
standard rejection rule of speculative sampling (accept with min(1, p/q) = p(token); on rejection
draw from max(0, p - q) normalized = p without the token): the distribution is the model's and a
seed gives the same reply with or without speculation, wherever the verify pass (a prefill kernel)
and the decode step give the same logits. The same definition as web/src/speculative.js.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError
from kiln.runtime import reusable_prefix

METHODS = ("prompt-lookup", "draft")
OFF = "off"


@dataclass(frozen=True)
class Speculation:
    """How an engine proposes tokens: `method` "prompt-lookup" or "draft" (with `draft`, the draft
    model's folder); n-grams of `ngram_min` to `ngram_max` tokens are looked up; a proposal has at
    most `max_proposal` tokens, `first_proposal` at first, then adapted to what was accepted."""

    method: str
    draft: Path | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    first_proposal: int = 4
    max_proposal: int = 12

    @classmethod
    def parse(cls, text: str) -> Speculation | None:
        """`prompt-lookup`, `draft:PATH` or `off` (None), as `--speculative` takes them."""
        if text == OFF:
            return None
        if text == "prompt-lookup":
            return cls("prompt-lookup")
        if text.startswith("draft:") and text[len("draft:") :]:
            return cls("draft", Path(text[len("draft:") :]))
        raise KilnError(f"--speculative takes prompt-lookup, draft:MODEL_DIR or off, not {text!r}")

    def check(self) -> None:
        if self.method not in METHODS:
            raise KilnError(f"the speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise KilnError(
                f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if not 1 <= self.first_proposal <= self.max_proposal:
            raise KilnError(
                "proposal lengths must satisfy 1 <= first_proposal <= max_proposal, "
                f"got {self.first_proposal}, {self.max_proposal}"
            )


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the last n tokens of the history
    (prompt and reply), the longest n from `ngram_max` down to `ngram_min` that occurs."""

    def __init__(self, speculation: Speculation, history: list[int]):
        self.sizes = range(speculation.ngram_max, speculation.ngram_min - 1, -1)
        self.history: list[int] = []
        # per size: n-gram → where its latest occurrence with a token after it starts
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.extend(history)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.history.append(token)
            for n, latest in self.latest.items():
                start = len(self.history) - 1 - n
                if start >= 0:
                    latest[tuple(self.history[start : start + n])] = start

    def propose(self, count: int) -> list[int]:
        for n in self.sizes:
            start = self.latest[n].get(tuple(self.history[-n:])) if len(self.history) >= n else None
            if start is not None:
                return self.history[start + n : start + n + count]
        return []


class DraftModel:
    """A small model with the target's tokenizer, and the tokens its KV cache holds: it proposes its
    greedy continuation of a history, keeping the longest prefix of it the cache holds."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # the tokens both models have (a vocabulary may be padded)
        self.cached: list[int] = []

    def continuation(self, history: list[int], count: int) -> list[int]:
        model = self.model
        count = min(count, model.context_window_size - len(history))
        if count <= 0:
            return []
        kept = model.rollback(len(self.cached) - reusable_prefix(self.cached, history))
        del self.cached[kept:]
        logits = model.prefill(history[kept:])
        self.cached.extend(history[kept:])
        proposal = []
        while True:
            proposal.append(int(np.argmax(logits[: self.vocab_size])))
            if len(proposal) == count:
                return proposal
            logits = model.decode(proposal[-1])
            self.cached.append(proposal[-1])

    def reset(self) -> None:
        self.model.reset()
        self.cached = []


def check_same_vocabulary(target_tokenizer, draft_tokenizer, draft_dir: Path) -> None:
    """Refuse a draft model whose tokenizer gives any token another id than the target's."""
    target = target_tokenizer.get_vocab(with_added_tokens=True)
    draft = draft_tokenizer.get_vocab(with_added_tokens=True)
    if target == draft:
        return
    token, _ = min(set(target.items()) ^ set(draft.items()), key=lambda item: (item[1], item[0]))

    def where(vocabulary: dict[str, int]) -> str:
        return f"token {vocabulary[token]}" if token in vocabulary else "not a token"

    raise KilnError(
        f"the draft model's tokenizer is not the target model's ({len(draft)} tokens against {len(target)}; "
        f"{token!r} is {where(draft)} in the draft and {where(target)} in the target): a draft model must "
        "share the target's tokenizer",
        draft_dir,
    )


class DraftProposals:
    """A reply's proposer over a DraftModel."""

    def __init__(self, draft: DraftModel, history: list[int]):
        self.draft = draft
        self.history = list(history)

    def extend(self, tokens: list[int]) -> None:
        self.history.extend(tokens)

    def propose(self, count: int) -> list[int]:
        return self.draft.continuation(self.history, count)


@dataclass
class SpeculationStats:
    steps: int = 0  # model passes after the prompt's prefill (verify passes and decode steps)
    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, the ones the reply took


@dataclass
class Row:
    token: int  # the proposed token
    logits: np.ndarray  # the model's logits after it


class PlainDecoding:
    """One decode step per token: what `Lookahead` falls back to, and decoding without speculation."""

    def __init__(self, model):
        self.model = model
        self.stats = SpeculationStats()

    def logits_after(self, token: int) -> np.ndarray:
        self.stats.steps += 1
        return self.model.decode(token)

    def settle(self) -> None:
        """Leave the cache holding the reply's tokens and no proposed ones."""


class PassCosts:
    """Whether verify passes pay for themselves here, in time: a pass saves the decode steps of the
    tokens it took and costs what it takes beyond one decode step. Where their recent worth (a
    running mean) falls below zero, proposals pause for as many decode steps as keep the loss of
    the pass that lost within `LOSS_SHARE` of their time, then are tried again. Each pause after
    the first of a run of such losses (no pass saving time between them) is twice the one before,
    so that a reply with nothing to copy loses less the longer it runs; a pause is at most
    `MAX_PAUSE`. A pass costs several decode steps on a CPU and about one on a GPU, where a step is
    bound by its dispatches: the same rule pauses longer where passes cost more. Passes are judged
    against a decode step's time, so a pass before any decode step is followed by one. It changes
    how fast a reply comes, never which tokens it has."""

    LOSS_SHARE = 0.1
    MAX_PAUSE = 256

    def __init__(self):
        self.decode_s: float | None = None  # a decode step's time, a running mean
        self.worth = 0.0  # seconds a pass saved, a running mean
        self.pause = 0  # decode steps before the next proposal
        self.backoff = 1  # what the next pause is multiplied by: doubled at each, 1 once a pass saves time

    def decoded(self, seconds: float) -> None:
        self.decode_s = seconds if self.decode_s is None else 0.8 * self.decode_s + 0.2 * seconds

    def verified(self, seconds: float, accepted: int) -> None:
        if self.decode_s is None:  # no decode step to judge it by yet: take one next (a draft always proposes)
            self.pause = 1
            return
        saved = accepted * self.decode_s - (seconds - self.decode_s)
        self.worth = 0.5 * self.worth + 0.5 * saved
        if saved > 0:
            self.backoff = 1
        elif saved < 0 and self.worth < 0:
            self.pause = min(self.MAX_PAUSE, math.ceil(-saved / (self.LOSS_SHARE * self.decode_s)) * self.backoff)
            self.backoff = min(self.MAX_PAUSE, 2 * self.backoff)
            self.worth = 0.0

    def may_propose(self) -> bool:
        if self.pause:
            self.pause -= 1
            return False
        return True


class Lookahead(PlainDecoding):
    """Verified rows ahead of the reply (see the module's docstring). A proposal's length starts at
    `first_proposal`, doubles (up to `max_proposal`) after one the reply took whole and halves after
    one it left; it stops where the cache could no longer roll it back, and pauses where passes do
    not pay (`PassCosts`). `constraint` (a reply's TokenConstraint) cuts a proposal at its first
    token the response format does not allow."""

    def __init__(self, model, proposer, speculation: Speculation, constraint=None):
        super().__init__(model)
        self.proposer = proposer
        self.speculation = speculation
        self.constraint = constraint
        self.proposal_length = speculation.first_proposal
        self.rows: list[Row] = []
        self.costs = PassCosts()
        self.pass_s = 0.0  # the time of the pass the rows came from
        self.pass_accepted = 0  # its rows the reply took so far

    def logits_after(self, token: int) -> np.ndarray:
        self.proposer.extend([token])
        if self.rows and self.rows[0].token == token:
            self.stats.accepted += 1
            self.pass_accepted += 1
            row = self.rows.pop(0)
            if not self.rows:  # every proposed token taken: propose more next time
                self.proposal_length = min(self.speculation.max_proposal, self.proposal_length * 2)
                self.costs.verified(self.pass_s, self.pass_accepted)
            return row.logits
        if self.rows:  # the reply went another way: forget the rest
            self.proposal_length = max(1, self.proposal_length // 2)
            self.costs.verified(self.pass_s, self.pass_accepted)
            self.settle()
        proposal = self.proposal(token) if self.costs.may_propose() else []
        started = time.perf_counter()
        if not proposal:
            logits = super().logits_after(token)
            self.costs.decoded(time.perf_counter() - started)
            return logits
        self.stats.steps += 1
        self.stats.proposed += len(proposal)
        logits = self.model.all_logits([token, *proposal])
        self.pass_s, self.pass_accepted = time.perf_counter() - started, 0
        self.rows = [Row(t, row) for t, row in zip(proposal, logits[1:])]
        return logits[0]

    def proposal(self, token: int) -> list[int]:
        room = self.model.speculation_room() - 1  # the token itself goes first
        proposal = self.proposer.propose(min(self.proposal_length, room)) if room > 0 else []
        if proposal and self.constraint is not None:  # (it has taken `token` already)
            proposal = proposal[: self.constraint.fitting(proposal)]
        return proposal

    def settle(self) -> None:
        if self.rows:
            self.model.rollback(len(self.rows))
            self.rows = []


def decoding_steps(
    model, speculation: Speculation | None, draft: DraftModel | None, prompt_ids: list[int], constraint
) -> PlainDecoding:
    """What runs a reply's model steps after its prompt: plain decoding or a Lookahead."""
    if speculation is None:
        return PlainDecoding(model)
    if speculation.method == "draft":
        if draft is None:
            raise KilnError("speculative decoding with a draft model needs the engine to load one (draft:MODEL_DIR)")
        return Lookahead(model, DraftProposals(draft, prompt_ids), speculation, constraint)
    return Lookahead(model, PromptLookup(speculation, prompt_ids), speculation, constraint)
