"""`kiln bench native --speculative`: greedy replies to three kinds of task, decoded plainly and
speculatively by one engine in one sitting: decode tokens/s of each, their ratio, proposed tokens
accepted per verify pass and model steps per token, and whether the two replies are the same.

The tasks are written down here, so that every run and every engine asks the same: rewriting a
given function with type hints (the reply copies its input), answering from a pasted paragraph by
quoting it, and free chat (where nothing is there to copy: speculation must not cost much).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

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


def bench_speculative(engine: Engine, max_tokens: int = 256, runs: int = 3) -> dict:
    """Each task's reply `runs` times each way (after one warm-up of each), medians reported."""
    method = engine.speculation.method
    config = GenerationConfig(max_tokens=max_tokens)
    tasks = {}
    for name, prompt in TASKS.items():
        messages = [{"role": "user", "content": prompt}]
        results = {mode: [] for mode in (OFF, method)}
        for run in range(runs + 1):
            for mode in results:
                engine.reset()
                result = engine.generate_chat(messages, replace(config, speculative=mode))
                if run:  # the first run of each warms up
                    results[mode].append(result)
        plain, speculative = results[OFF], results[method]

        def median(results, key):
            return statistics.median(getattr(r.usage, key) for r in results)

        usage = speculative[-1].usage
        plain_rate, speculative_rate = median(plain, "decode_tokens_per_s"), median(speculative, "decode_tokens_per_s")
        tasks[name] = {
            "tokens": len(speculative[-1].tokens),
            "plain_decode_tokens_per_s": plain_rate,
            "speculative_decode_tokens_per_s": speculative_rate,
            "speed_up": speculative_rate / plain_rate if plain_rate else 0.0,
            "verify_steps": usage.model_steps,
            "accepted_per_step": usage.accepted_tokens / usage.model_steps if usage.model_steps else 0.0,
            "steps_per_token": usage.model_steps / max(1, usage.completion_tokens - 1),
            "acceptance": usage.accepted_tokens / usage.proposed_tokens if usage.proposed_tokens else 0.0,
            "same_reply": plain[-1].tokens == speculative[-1].tokens,
        }
    lines = [f"{engine.model_id}: greedy replies of up to {max_tokens} tokens, plain and {method}, median of {runs}"]
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
    return {
        "model_id": engine.model_id,
        "method": method,
        "max_tokens": max_tokens,
        "runs": runs,
        "tasks": tasks,
        "lines": lines,
    }
