"""`kiln parity`: does the model in the browser generate what the native build generates?

Each prompt runs greedily natively and in the browser engine (headless Chromium, WebGPU or the
CPU wasm library), and the contract of DESIGN.md is checked:
- greedy token ids identical, except after a step whose native top-2 logit gap is below
  `near_tie_gap` (kernels round differently, so a near tie may flip: reported, not failed);
- forced decoding: the native sequence (prompt + native greedy tokens) is fed to both in one
  `prefill_all_logits` pass and their argmax must agree at ≥ `min_forced_top1_agreement` of the
  positions;
- the logits after the prompt within `max_last_logit_abs_diff`;
- the browser's tokenizer gives the prompt the native ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kiln.engine import load_tokenizer
from kiln.errors import KilnError
from kiln.runtime import NativeModel

from .browser_model import BrowserModel, browser_model

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
    min_forced_top1_agreement: float = 0.99


@dataclass
class PromptParity:
    prompt: str
    prompt_ids: list[int]
    tokenization_identical: bool
    native_tokens: list[int]
    browser_tokens: list[int]             # up to and including the first divergent token
    first_divergence: int | None          # the greedy step where the browser chose another token
    divergence_top2_gap: float | None     # the native top-2 logit gap at that step
    forced_positions: int
    forced_top1_agreed: int
    last_logit_abs_diff: float
    forced_max_logit_abs_diff: float

    def greedy_ok(self, contract: ParityContract) -> bool:
        return self.first_divergence is None or self.divergence_top2_gap < contract.near_tie_gap

    def to_json(self, contract: ParityContract) -> dict:
        return {**asdict(self), "greedy_identical": self.first_divergence is None,
                "greedy_ok": self.greedy_ok(contract),
                "forced_top1_agreement": self.forced_top1_agreed / self.forced_positions}


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


def top2_gap(logits: np.ndarray) -> float:
    second, first = np.partition(logits, -2)[-2:]
    return float(first - second)


def greedy(model, prompt_ids: list[int], max_tokens: int, stop_at: list[int] | None = None):
    """Greedy tokens and the logits of each step; with `stop_at`, stops after the first token
    that differs from it (the browser need not decode past a divergence)."""
    model.reset()
    logits = model.prefill(prompt_ids)
    tokens, steps = [], []
    while True:
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
        step = len(tokens) - 1
        if len(tokens) == max_tokens or (stop_at is not None and tokens[step] != stop_at[step]):
            return tokens, steps
        logits = model.decode(tokens[-1])


def compare_prompt(prompt: str, native: NativeModel, browser: BrowserModel, tokenizer, max_tokens: int,
                   forced_positions: int | None) -> PromptParity:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    browser_prompt_ids = [int(t) for t in browser.engine.call("session.encode", prompt)]
    native_tokens, native_steps = greedy(native, prompt_ids, max_tokens)
    browser_tokens, browser_steps = greedy(browser, prompt_ids, max_tokens, stop_at=native_tokens)
    divergence = next((step for step, (a, b) in enumerate(zip(native_tokens, browser_tokens)) if a != b), None)

    sequence = prompt_ids + native_tokens[:-1]  # the last token's logits are never needed
    native.reset()
    browser.reset()
    native_rows, browser_rows = native.all_logits(sequence), browser.all_logits(sequence)
    compared = slice(-forced_positions, None) if forced_positions else slice(None)
    native_rows, browser_rows = native_rows[compared], browser_rows[compared]
    return PromptParity(
        prompt=prompt, prompt_ids=prompt_ids, tokenization_identical=browser_prompt_ids == prompt_ids,
        native_tokens=native_tokens, browser_tokens=browser_tokens, first_divergence=divergence,
        divergence_top2_gap=None if divergence is None else top2_gap(native_steps[divergence]),
        forced_positions=len(native_rows),
        forced_top1_agreed=int((native_rows.argmax(-1) == browser_rows.argmax(-1)).sum()),
        last_logit_abs_diff=float(np.abs(native_steps[0] - browser_steps[0]).max()),
        forced_max_logit_abs_diff=float(np.abs(native_rows - browser_rows).max()),
    )


def check_contract(results: list[PromptParity], contract: ParityContract) -> list[str]:
    """What fails the contract, one line each (none: parity holds)."""
    failures = []
    for number, r in enumerate(results, 1):
        if not r.tokenization_identical:
            failures.append(f"prompt {number}: the browser's tokenizer gives other ids for the prompt")
        if not r.greedy_ok(contract):
            failures.append(f"prompt {number}: greedy tokens diverge at step {r.first_divergence} where the "
                            f"top-2 gap is {r.divergence_top2_gap:.2e} (≥ {contract.near_tie_gap:g}: no near tie)")
        if r.last_logit_abs_diff > contract.max_last_logit_abs_diff:
            failures.append(f"prompt {number}: last-token logits differ by {r.last_logit_abs_diff:.2e} "
                            f"(> {contract.max_last_logit_abs_diff:g})")
    agreement = forced_agreement(results)
    if agreement < contract.min_forced_top1_agreement:
        failures.append(f"forced-decoding top-1 agreement {agreement:.1%} "
                        f"(< {contract.min_forced_top1_agreement:.0%})")
    return failures


def forced_agreement(results: list[PromptParity]) -> float:
    return sum(r.forced_top1_agreed for r in results) / sum(r.forced_positions for r in results)


def run_parity(model_dir: Path, prompts: list[str], max_tokens: int = 32, forced_positions: int | None = None,
               backend: str = "auto", native_target: str = "cpu", contract: ParityContract = ParityContract(),
               browser_model_dir: Path | None = None) -> dict:
    """The parity report of `model_dir` (natively) against `browser_model_dir` (default: the same
    folder) in the browser; `passed` says whether the contract holds."""
    if max_tokens < 1:
        raise KilnError(f"--max-tokens must be at least 1, got {max_tokens}")
    if forced_positions is not None and forced_positions < 1:
        raise KilnError(f"--forced-positions must be at least 1, got {forced_positions}")
    model_dir = Path(model_dir)
    native = NativeModel(model_dir, native_target)
    tokenizer = load_tokenizer(model_dir)
    with browser_model(browser_model_dir or model_dir, backend) as browser:
        results = [compare_prompt(prompt, native, browser, tokenizer, max_tokens, forced_positions)
                   for prompt in tqdm(prompts, desc="parity", unit="prompt", leave=False, disable=None)]
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
        "greedy_identical": sum(r.first_divergence is None for r in results),
        "forced_top1_agreement": forced_agreement(results),
        "max_logit_abs_diff": max(r.last_logit_abs_diff for r in results),
        "forced_max_logit_abs_diff": max(r.forced_max_logit_abs_diff for r in results),
        "passed": not failures,
        "failures": failures,
    }
    report["lines"] = report_lines(report, results)
    return report


def report_lines(report: dict, results: list[PromptParity]) -> list[str]:
    on = f"WebGPU ({report['adapter']['vendor']} {report['adapter']['architecture']})" if report["adapter"] \
        else "CPU wasm"
    lines = [f"{report['model']}: native {report['native']} vs the browser on {on}, {len(results)} prompt(s), "
             f"{report['max_tokens']} greedy token(s)"]
    for number, r in enumerate(results, 1):
        if r.first_divergence is None:
            greedy_text = f"greedy identical ({len(r.native_tokens)}/{len(r.native_tokens)})"
        else:
            greedy_text = (f"greedy diverges at step {r.first_divergence} "
                           f"(native top-2 gap {r.divergence_top2_gap:.1e})")
        lines.append(f"  prompt {number:<3} {greedy_text:44} forced top-1 {r.forced_top1_agreed}/{r.forced_positions}"
                     f"   last-token max|Δ| {r.last_logit_abs_diff:.1e}")
    lines.append(f"{'PASS' if report['passed'] else 'FAIL'}: greedy identical {report['greedy_identical']}/"
                 f"{len(results)}, forced top-1 {report['forced_top1_agreement']:.1%}, "
                 f"last-token max|Δ| {report['max_logit_abs_diff']:.1e} "
                 f"(all positions {report['forced_max_logit_abs_diff']:.1e})")
    lines.extend(f"  {failure}" for failure in report["failures"])
    return lines
