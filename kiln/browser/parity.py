"""`kiln parity`: does the model in the browser generate what the native build generates?

Each prompt runs greedily natively and in the browser engine (headless Chromium, WebGPU or the
CPU wasm library), and this contract is checked for every prompt on its own:
- every logit either side is finite;
- the browser's tokenizer gives the prompt the native ids;
- greedy token ids identical, except at a near tie: the native top-2 logit gap is below
  `near_tie_gap` and the browser chose the native runner-up (kernels round differently, so a
  near tie may flip: reported, not failed);
- forced decoding: the native sequence (prompt + native greedy tokens) is fed to both in one
  `prefill_all_logits` pass and their argmax agrees, or flips at a near tie, at
  ≥ `min_forced_top1_agreement` of the compared positions. The compared positions always include
  every one after a greedy divergence, so the rest of an exempted sequence is still checked;
- the logits after the prompt within `max_last_logit_abs_diff`, or `max_last_logit_rel_diff` of the
  largest native one where that is more.
A model whose matmuls take 8-bit activations (`gguf_i8`) is held to the tolerance its quantization
states (`ParityContract.of`): a rounding apart anywhere upstream of a quantized row moves what follows
by up to that much, in one engine as between two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kiln.app_config import BUILD_RECORD
from kiln.compile.quantization import QUANTIZATIONS
from kiln.compile.quantization.gguf_blocks import INT8_LOGIT_TOLERANCE, INT8_NEAR_TIE
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.runtime import NativeModel
from kiln.text import load_tokenizer

from .model import BrowserModel, browser_model

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains,",
)


@dataclass(frozen=True)
class ParityContract:
    near_tie_gap: float = 1e-3
    max_last_logit_abs_diff: float = 1e-2
    max_last_logit_rel_diff: float = 0.0  # of the largest native logit
    min_forced_top1_agreement: float = 0.99

    @classmethod
    def of(cls, model_dir: Path) -> ParityContract:
        """The contract for the model's quantization: a float one's, or the tolerance of 8-bit activations."""
        quantization = QUANTIZATIONS.get(read_json(Path(model_dir) / BUILD_RECORD).get("quantization", ""))
        if getattr(quantization, "int8_activations", False):
            return cls(near_tie_gap=INT8_NEAR_TIE, max_last_logit_rel_diff=INT8_LOGIT_TOLERANCE)
        return cls()

    def last_logit_diff_allowed(self, largest: float) -> float:
        return max(self.max_last_logit_abs_diff, self.max_last_logit_rel_diff * largest)


@dataclass(frozen=True)
class Flip:
    """A position where the browser's argmax is not the native one."""

    position: int  # the greedy step, or the index in the forced sequence
    native_token: int
    browser_token: int
    native_runner_up: int
    native_top2_gap: float

    def near_tie(self, contract: ParityContract) -> bool:
        return self.native_top2_gap < contract.near_tie_gap and self.browser_token == self.native_runner_up

    def describe(self) -> str:
        return (
            f"native {self.native_token} (top-2 gap {self.native_top2_gap:.2e}, runner-up "
            f"{self.native_runner_up}), browser {self.browser_token}"
        )


def flip_at(position: int, native_logits: np.ndarray, browser_token: int) -> Flip:
    runner_up, first = np.argsort(native_logits)[-2:]
    return Flip(
        position, int(first), int(browser_token), int(runner_up), float(native_logits[first] - native_logits[runner_up])
    )


def non_finite(**logits: np.ndarray) -> list[str]:
    """The named logit arrays holding a NaN or an infinity."""
    return [name for name, values in logits.items() if values.size and not np.isfinite(values).all()]


@dataclass
class PromptParity:
    prompt: str
    prompt_ids: list[int]
    tokenization_identical: bool
    native_tokens: list[int]
    browser_tokens: list[int]  # up to and including the first divergent token
    greedy_flip: Flip | None  # the first greedy step where the browser chose another token
    forced_start: int  # the first compared position of the forced sequence
    forced_positions: int
    forced_flips: list[Flip]
    non_finite: list[str]  # which logits held a NaN or an infinity
    last_logit_abs_diff: float
    last_logit_largest: float  # the largest native logit after the prompt, in magnitude
    forced_max_logit_abs_diff: float

    @property
    def first_divergence(self) -> int | None:
        return None if self.greedy_flip is None else self.greedy_flip.position

    def greedy_ok(self, contract: ParityContract) -> bool:
        return self.greedy_flip is None or self.greedy_flip.near_tie(contract)

    def forced_near_ties(self, contract: ParityContract) -> int:
        return sum(flip.near_tie(contract) for flip in self.forced_flips)

    def forced_agreement(self, contract: ParityContract) -> float:
        """The share of compared positions where the argmax agrees or flips at a near tie."""
        explained = self.forced_positions - len(self.forced_flips) + self.forced_near_ties(contract)
        return explained / self.forced_positions

    def failures(self, contract: ParityContract) -> list[str]:
        """What fails the contract for this prompt, one line each."""
        failures = []
        if self.non_finite:
            failures.append(f"non-finite logits (NaN or infinity) in {', '.join(self.non_finite)}")
        if not self.tokenization_identical:
            failures.append("the browser's tokenizer gives other ids for the prompt")
        if not self.greedy_ok(contract):
            failures.append(
                f"greedy tokens diverge at step {self.first_divergence} without a near tie: "
                f"{self.greedy_flip.describe()}"
            )
        agreement = self.forced_agreement(contract)
        if agreement < contract.min_forced_top1_agreement:
            unexplained = [flip for flip in self.forced_flips if not flip.near_tie(contract)]
            failures.append(
                f"forced-decoding top-1 agreement {agreement:.1%} "
                f"(< {contract.min_forced_top1_agreement:.0%}), "
                f"first at position {unexplained[0].position}: {unexplained[0].describe()}"
            )
        allowed = contract.last_logit_diff_allowed(self.last_logit_largest)
        if not self.last_logit_abs_diff <= allowed:
            failures.append(f"last-token logits differ by {self.last_logit_abs_diff:.2e} (> {allowed:g})")
        return failures

    def to_json(self, contract: ParityContract) -> dict:
        return {
            **asdict(self),
            "first_divergence": self.first_divergence,
            "greedy_identical": self.greedy_flip is None,
            "greedy_ok": self.greedy_ok(contract),
            "forced_top1_agreed": self.forced_positions - len(self.forced_flips),
            "forced_near_ties": self.forced_near_ties(contract),
            "forced_top1_agreement": self.forced_agreement(contract),
            "failures": self.failures(contract),
        }


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except FileNotFoundError:
        raise KilnError("no such prompts file", path) from None
    except UnicodeDecodeError as e:
        raise KilnError(f"the prompts file is not UTF-8 text ({e.reason} at byte {e.start})", path) from None
    prompts = [prompt for prompt in prompts if prompt]
    if not prompts:
        raise KilnError("the prompts file has no prompts (one per line)", path)
    return prompts


def greedy(model, prompt_ids: list[int], max_tokens: int, stop_at: list[int] | None = None) -> list[np.ndarray]:
    """The logits of each greedy step; with `stop_at`, stops after the first step whose argmax
    differs from it (the browser need not decode past a divergence)."""
    model.reset()
    logits = model.prefill(prompt_ids)
    steps = []
    while True:
        steps.append(logits)
        token = int(np.argmax(logits))
        if len(steps) == max_tokens or (stop_at is not None and token != stop_at[len(steps) - 1]):
            return steps
        logits = model.decode(token)


def judge_prompt(
    prompt: str,
    prompt_ids: list[int],
    browser_prompt_ids: list[int],
    native_steps: list[np.ndarray],
    browser_steps: list[np.ndarray],
    native_rows: np.ndarray,
    browser_rows: np.ndarray,
    forced_positions: int | None = None,
) -> PromptParity:
    """Compare one prompt's runs: the logits of each greedy step either side (the browser's up to
    its first divergence) and of each position of the forced sequence, prompt + native greedy
    tokens. `forced_positions` compares only the last ones, and always every position from the
    greedy divergence on."""
    native_tokens = [int(np.argmax(logits)) for logits in native_steps]
    browser_tokens = [int(np.argmax(logits)) for logits in browser_steps]
    divergence = next((step for step, (a, b) in enumerate(zip(native_tokens, browser_tokens)) if a != b), None)
    greedy_flip = (
        None if divergence is None else flip_at(divergence, native_steps[divergence], browser_tokens[divergence])
    )

    start = len(native_rows) - forced_positions if forced_positions else 0
    if divergence is not None:
        start = min(start, len(prompt_ids) - 1 + divergence)  # the row predicting the divergent step
    start = max(start, 0)
    native_argmax, browser_argmax = native_rows.argmax(-1), browser_rows.argmax(-1)
    forced_flips = [
        flip_at(position, native_rows[position], browser_argmax[position])
        for position in range(start, len(native_rows))
        if native_argmax[position] != browser_argmax[position]
    ]
    return PromptParity(
        prompt=prompt,
        prompt_ids=prompt_ids,
        tokenization_identical=browser_prompt_ids == prompt_ids,
        native_tokens=native_tokens,
        browser_tokens=browser_tokens,
        greedy_flip=greedy_flip,
        forced_start=start,
        forced_positions=len(native_rows) - start,
        forced_flips=forced_flips,
        non_finite=non_finite(
            native_greedy=np.stack(native_steps),
            browser_greedy=np.stack(browser_steps),
            native_forced=native_rows,
            browser_forced=browser_rows,
        ),
        last_logit_abs_diff=float(np.abs(native_steps[0] - browser_steps[0]).max()),
        last_logit_largest=float(np.abs(native_steps[0]).max()),
        forced_max_logit_abs_diff=float(np.abs(native_rows[start:] - browser_rows[start:]).max()),
    )


def compare_prompt(
    prompt: str, native: NativeModel, browser: BrowserModel, tokenizer, max_tokens: int, forced_positions: int | None
) -> PromptParity:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    browser_prompt_ids = [int(t) for t in browser.engine.call("session.encodeText", prompt)]
    native_steps = greedy(native, prompt_ids, max_tokens)
    native_tokens = [int(np.argmax(logits)) for logits in native_steps]
    browser_steps = greedy(browser, prompt_ids, max_tokens, stop_at=native_tokens)
    sequence = prompt_ids + native_tokens[:-1]  # the last token's logits are never needed
    native.reset()
    browser.reset()
    return judge_prompt(
        prompt,
        prompt_ids,
        browser_prompt_ids,
        native_steps,
        browser_steps,
        native.all_logits(sequence),
        browser.all_logits(sequence),
        forced_positions,
    )


def check_contract(results: list[PromptParity], contract: ParityContract) -> list[str]:
    """What fails the contract, one line each (none: parity holds)."""
    return [f"prompt {number}: {failure}" for number, r in enumerate(results, 1) for failure in r.failures(contract)]


def run_parity(
    model_dir: Path,
    prompts: list[str],
    max_tokens: int = 32,
    forced_positions: int | None = None,
    backend: str = "auto",
    native_target: str = "cpu",
    contract: ParityContract | None = None,
    browser_model_dir: Path | None = None,
) -> dict:
    """The parity report of `model_dir` (natively) against `browser_model_dir` (default: the same
    folder) in the browser; `passed` says whether the contract (default: the model's) holds."""
    if max_tokens < 1:
        raise KilnError(f"--max-tokens must be at least 1, got {max_tokens}")
    if forced_positions is not None and forced_positions < 1:
        raise KilnError(f"--forced-positions must be at least 1, got {forced_positions}")
    model_dir = Path(model_dir)
    contract = contract or ParityContract.of(model_dir)
    native = NativeModel(model_dir, native_target)
    tokenizer = load_tokenizer(model_dir)
    with browser_model(browser_model_dir or model_dir, backend) as browser:
        results = [
            compare_prompt(prompt, native, browser, tokenizer, max_tokens, forced_positions)
            for prompt in tqdm(prompts, desc="parity", unit="prompt", leave=False, disable=None)
        ]
        device, adapter = browser.backend, browser.adapter
    failures = check_contract(results, contract)
    report = {
        "model": model_dir.name,
        "native": native_target,
        "browser": device,
        "adapter": adapter,
        "max_tokens": max_tokens,
        "contract": asdict(contract),
        "prompts": [r.to_json(contract) for r in results],
        "greedy_identical": sum(r.greedy_flip is None for r in results),
        "forced_top1_agreement": min(r.forced_agreement(contract) for r in results),  # the worst prompt's
        "max_logit_abs_diff": max(r.last_logit_abs_diff for r in results),
        "forced_max_logit_abs_diff": max(r.forced_max_logit_abs_diff for r in results),
        "passed": not failures,
        "failures": failures,
    }
    report["lines"] = report_lines(report, results, contract)
    return report


def report_lines(report: dict, results: list[PromptParity], contract: ParityContract) -> list[str]:
    on = (
        f"WebGPU ({report['adapter']['vendor']} {report['adapter']['architecture']}, the {report['browser']} library)"
        if report["adapter"]
        else "CPU wasm"
    )
    lines = [
        f"{report['model']}: native {report['native']} vs the browser on {on}, {len(results)} prompt(s), "
        f"{report['max_tokens']} greedy token(s)"
    ]
    for number, r in enumerate(results, 1):
        if r.greedy_flip is None:
            greedy_text = f"greedy identical ({len(r.native_tokens)}/{len(r.native_tokens)})"
        else:
            near_tie = " near tie" if r.greedy_flip.near_tie(contract) else ""
            greedy_text = (
                f"greedy diverges at step {r.first_divergence}{near_tie} (gap {r.greedy_flip.native_top2_gap:.1e})"
            )
        near_ties = f" (+{r.forced_near_ties(contract)} near tie)" if r.forced_near_ties(contract) else ""
        lines.append(
            f"  prompt {number:<3} {greedy_text:44} forced top-1 "
            f"{r.forced_positions - len(r.forced_flips)}/{r.forced_positions}{near_ties}"
            f"   last-token max|Δ| {r.last_logit_abs_diff:.1e}"
        )
    lines.append(
        f"{'PASS' if report['passed'] else 'FAIL'}: greedy identical {report['greedy_identical']}/"
        f"{len(results)}, forced top-1 ≥ {report['forced_top1_agreement']:.1%} on every prompt, "
        f"last-token max|Δ| {report['max_logit_abs_diff']:.1e} "
        f"(all positions {report['forced_max_logit_abs_diff']:.1e})"
    )
    lines.extend(f"  {failure}" for failure in report["failures"])
    return lines
