"""A reply's model steps as a speculative engine's PassCosts chooses them, with costs made up."""

from __future__ import annotations

# (tokens, pass_steps, accepted): passes that lose, that pay, and that pay at times.
REPLIES = [(300, 4.0, 0), (300, 2.0, 3), (300, 5.5, 1), (300, 3.0, 2)]


def simulated_reply(costs, tokens: int, pass_steps: float, accepted: int) -> tuple[float, list[int]]:
    """A reply of `tokens` whose every verify pass costs `pass_steps` decode steps and takes
    `accepted` proposed tokens, under `costs` (a decode step takes 1): its time, and what each model
    step was (-1 a decode step, else a pass's accepted tokens). web/test_web_units.py replays it with
    the browser engine's PassCosts."""
    time, steps, made = 0.0, [], 0
    while made < tokens:
        if costs.may_propose():
            time += pass_steps
            costs.verified(pass_steps, accepted)
            steps.append(accepted)
            made += 1 + accepted
        else:
            time += 1.0
            costs.decoded(1.0)
            steps.append(-1)
            made += 1
    return time, steps
