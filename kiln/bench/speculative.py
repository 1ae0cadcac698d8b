"""`kiln bench native|browser --speculative`: greedy replies to three kinds of task, decoded plainly
and speculatively by one engine in one sitting: decode tokens/s of each, their ratio, proposed tokens
accepted per verify pass and model steps per token, and whether the two replies are the same.

The tasks are written down here, so that every run and every engine asks the same: rewriting a
given function with type hints (the reply copies its input), answering from a pasted paragraph by
quoting it, and free chat (where nothing is there to copy: speculation must not cost much).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from kiln.browser.driver import PageEngine
from kiln.engine import Engine, GenerationConfig
from kiln.speculative import OFF

FUNCTION = """def summarize(records, field, limit=None, skip_empty=True):
    totals = {}
    counts = {}
    for record in records:
        value = record.get(field)
        if value is None and skip_empty:
            continue
        key = record.get("group", "other")
        totals[key] = totals.get(key, 0) + (value or 0)
        counts[key] = counts.get(key, 0) + 1
    rows = []
    for key in sorted(totals):
        average = totals[key] / counts[key]
        rows.append({"group": key, "total": totals[key], "count": counts[key], "average": average})
    rows.sort(key=lambda row: row["total"], reverse=True)
    if limit is not None:
        rows = rows[:limit]
    return rows


def format_rows(rows, width=12):
    lines = []
    header = "group".ljust(width) + "total".rjust(width) + "average".rjust(width)
    lines.append(header)
    lines.append("-" * len(header))
    for row in rows:
        line = row["group"].ljust(width)
        line += str(row["total"]).rjust(width)
        line += f"{row['average']:.2f}".rjust(width)
        lines.append(line)
    return "\\n".join(lines)"""

PARAGRAPH = (
    "The lighthouse at Point Arena was first lit in 1870. Its original tower was built of brick and "
    "stood 100 feet tall, but the earthquake of April 18, 1906 damaged it so badly that it had to be "
    "torn down. A new tower, 115 feet tall and made of reinforced concrete, was finished in 1908. It "
    "held a first-order Fresnel lens made in France, which weighed more than six tons and floated on a "
    "bath of mercury so that it could turn with little effort. The lens was replaced by an automated "
    "beacon in 1977, and the keepers left the station the same year."
)

TASKS = {
    "rewrite": "Rewrite this Python code exactly as it is, adding type hints to every function and "
    f"parameter. Reply with the code only.\n\n{FUNCTION}",
    "quote": f"{PARAGRAPH}\n\nWhat happened to the original tower, and what replaced it? Answer by quoting "
    "the sentences of the text above that say so, word for word.",
    "chat": "Tell me a short story about a fox who learns to paint.",
}


@dataclass
class Reply:
    """A greedy reply to a task, as an engine reports it."""

    tokens: list[int]
    decode_tokens_per_s: float
    model_steps: int
    proposed_tokens: int
    accepted_tokens: int


def native_replies(engine: Engine, max_tokens: int) -> Callable[[list[dict], str], Reply]:
    """Replies of the native engine (its cache forgotten first), plain ("off") or speculative."""

    def reply(messages: list[dict], mode: str) -> Reply:
        engine.reset()
        result = engine.generate_chat(messages, GenerationConfig(max_tokens=max_tokens, speculative=mode))
        u = result.usage
        return Reply(result.tokens, u.decode_tokens_per_s, u.model_steps, u.proposed_tokens, u.accepted_tokens)

    return reply


def browser_replies(engine: PageEngine, max_tokens: int) -> Callable[[list[dict], str], Reply]:
    """Replies of the browser engine's own chat completion, as native_replies."""

    def reply(messages: list[dict], mode: str) -> Reply:
        engine.call("resetChat")
        request = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "speculative": mode}
        extra = engine.chat(request)["completion"]["usage"]["extra"]
        tokens = engine.call("stats")["last_request"]["token_ids"]
        return Reply(
            tokens,
            extra["decode_tokens_per_s"],
            extra["model_steps"],
            extra["proposed_tokens"],
            extra["accepted_tokens"],
        )

    return reply


def bench_speculative(
    reply: Callable[[list[dict], str], Reply], model_id: str, where: str, method: str, runs: int = 3
) -> dict:
    """Each task's reply `runs` times each way, in turn (after one warm-up of each), medians reported;
    the speed-up is the median of each run's pair's ratio, which holds when the machine's speed drifts
    between runs (on a shared 2-core VM plain decoding's rate moved from 86 to 146 tokens/s in minutes)."""
    tasks = {}
    for name, prompt in TASKS.items():
        messages = [{"role": "user", "content": prompt}]
        replies: dict[str, list[Reply]] = {OFF: [], method: []}
        for run in range(runs + 1):
            for mode, kept in replies.items():
                result = reply(messages, mode)
                if run:  # the first run of each warms up
                    kept.append(result)
        plain, speculative = replies[OFF], replies[method]
        plain_rate = statistics.median(r.decode_tokens_per_s for r in plain)
        speculative_rate = statistics.median(r.decode_tokens_per_s for r in speculative)
        last = speculative[-1]
        tasks[name] = {
            "tokens": len(last.tokens),
            "plain_decode_tokens_per_s": plain_rate,
            "speculative_decode_tokens_per_s": speculative_rate,
            "speed_up": statistics.median(
                s.decode_tokens_per_s / p.decode_tokens_per_s if p.decode_tokens_per_s else 0.0
                for p, s in zip(plain, speculative)
            ),
            "model_steps": last.model_steps,
            "accepted_per_step": last.accepted_tokens / last.model_steps if last.model_steps else 0.0,
            "steps_per_token": last.model_steps / max(1, len(last.tokens) - 1),
            "acceptance": last.accepted_tokens / last.proposed_tokens if last.proposed_tokens else 0.0,
            "same_reply": plain[-1].tokens == last.tokens,
        }
    lines = [f"{model_id} on {where}: greedy replies, plain and {method}, median of {runs} after a warm-up"]
    lines.append(
        f"  {'task':8} {'tokens':>6} {'plain':>8} {method:>14} {'speed-up':>9} {'acc/step':>9} {'steps/tok':>10}  same"
    )
    for name, t in tasks.items():
        lines.append(
            f"  {name:8} {t['tokens']:6d} {t['plain_decode_tokens_per_s']:8.1f} "
            f"{t['speculative_decode_tokens_per_s']:14.1f} "
            f"{t['speed_up']:8.2f}× {t['accepted_per_step']:9.2f} {t['steps_per_token']:10.2f}  "
            f"{'yes' if t['same_reply'] else 'NO'}"
        )
    lines.append("  (tokens/s of decoding: tokens after the first ÷ the time from the first to the last;")
    lines.append("   the speed-up is the median of each run's ratio of the two)")
    return {"model_id": model_id, "where": where, "method": method, "runs": runs, "tasks": tasks, "lines": lines}
