"""The mobile runtime's pass costs (kiln/mobile/runtime/pass_costs.cc) are `kiln.speculative.PassCosts`:
on helpers/simulated_reply.py's replies it takes the same steps, and its reply time is Python's to
the bit."""

from __future__ import annotations

from helpers.host_cpp import DriverProcess, host_program
from helpers.simulated_reply import REPLIES, simulated_reply

from kiln.speculative import PassCosts


def test_verify_passes_pause_as_natively(tmp_path):
    driver = DriverProcess(host_program("pass_costs.cc", ["pass_costs.cc"], tmp_path))
    try:
        for tokens, pass_steps, accepted in REPLIES:
            time, steps = simulated_reply(PassCosts(), tokens, pass_steps, accepted)
            reply = driver.ask({"tokens": tokens, "pass_steps": pass_steps, "accepted": accepted})
            assert (float.fromhex(reply["time"]), reply["steps"]) == (time, steps)
    finally:
        driver.close()
