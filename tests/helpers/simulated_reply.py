"""A reply's model steps as a speculative engine's PassCosts chooses them, with costs made up."""

from __future__ import annotations

# (tokens, pass_steps, accepted): passes that lose, that pay, that pay at times, and a run of losses
# that a pass saving time ends.
REPLIES = [(300, 4.0, [0]), (300, 2.0, [3]), (300, 5.5, [1]), (300, 3.0, [2]), (400, 2.0, [0, 0, 0, 3])]


def simulated_reply(costs, tokens: int, pass_steps: float, accepted: list[int]) -> tuple[float, list[int]]:
    """A reply of `tokens` whose every verify pass costs `pass_steps` decode steps and takes the next
    of `accepted` proposed tokens (in turn, from the first again after the last), under `costs` (a
    decode step takes 1): its time, and what each model step was (-1 a decode step, else a pass's
    accepted tokens). web/test_web_units.py and mobile/test_pass_costs.py replay it with the browser
    engine's and the mobile runtime's PassCosts."""
    time, steps, made, passes = 0.0, [], 0, 0
    while made < tokens:
        if costs.may_propose():
            taken = accepted[passes % len(accepted)]
            passes += 1
            time += pass_steps
            costs.verified(pass_steps, taken)
            steps.append(taken)
            made += 1 + taken
        else:
            time += 1.0
            costs.decoded(1.0)
            steps.append(-1)
            made += 1
    return time, steps
