"""`kiln chat`: an interactive conversation in the terminal, streamed as the model writes.

Ctrl-C while the model replies interrupts the engine (the reply ends, the chat goes on); at the
prompt it only reminds how to leave. The conversation keeps the engine's KV cache between turns,
so each turn prefills only what the user just typed (see `/stats`).
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import TextIO

from kiln.engine import Engine, GenerationConfig, Usage
from kiln.errors import KilnError

COMMANDS = """commands:
  /reset         start a new conversation
  /system TEXT   start a new conversation with this system message (/system alone: the model's default)
  /stats         numbers of the last reply
  /exit          leave (or Ctrl-D)"""


@contextmanager
def interrupt_on_ctrl_c(engine: Engine):
    previous = signal.signal(signal.SIGINT, lambda signum, frame: engine.interrupt())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def describe_usage(usage: Usage) -> str:
    return (
        f"prompt {usage.prompt_tokens} tokens ({usage.prefilled_tokens} prefilled, "
        f"{usage.prefill_tokens_per_s:.1f} tok/s), reply {usage.completion_tokens} tokens "
        f"(decode {usage.decode_tokens_per_s:.1f} tok/s), time to first token {usage.ttft_s:.2f} s, "
        f"total {usage.total_s:.2f} s"
    )


class TerminalChat:
    def __init__(self, engine: Engine, config: GenerationConfig, out: TextIO = sys.stdout):
        engine.require_chat_template()
        self.engine = engine
        self.config = config
        self.out = out
        self.system_message: str | None = None
        self.messages: list[dict] = []
        self.last_usage: Usage | None = None

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def run(self) -> None:
        self.say(f"kiln chat: {self.engine.model_id} — /help for commands, /exit or Ctrl-D to leave")
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:
                self.say("\n(/exit or Ctrl-D to leave)")
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
            elif line.strip():
                self.reply(line)

    def command(self, line: str) -> bool:
        """Run a /command; False when the chat should end."""
        name, _, argument = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.new_conversation(self.system_message)
            self.say("(new conversation)")
        elif name == "/system":
            self.new_conversation(argument.strip() or None)
            system = "this system message" if argument.strip() else "the default system message"
            self.say(f"(new conversation with {system})")
        elif name == "/stats":
            self.say(describe_usage(self.last_usage) if self.last_usage else "(no reply yet)")
        elif name == "/help":
            self.say(COMMANDS)
        else:
            self.say(f"unknown command {name}\n{COMMANDS}")
        return True

    def new_conversation(self, system_message: str | None) -> None:
        self.system_message = system_message
        self.messages = []
        self.engine.reset()

    def reply(self, user_text: str) -> None:
        system = [{"role": "system", "content": self.system_message}] if self.system_message else []
        conversation = [*system, *self.messages, {"role": "user", "content": user_text}]
        pieces = []
        try:
            with interrupt_on_ctrl_c(self.engine):
                for delta in self.engine.stream_chat(conversation, self.config):
                    print(delta.text, end="", file=self.out, flush=True)
                    pieces.append(delta.text)
        except KilnError as e:
            self.say(f"\nerror: {e}" + ("\n(/reset starts a new conversation)" if "context window" in str(e) else ""))
            return
        self.say({"abort": " [interrupted]", "length": " [max tokens reached]"}.get(delta.finish_reason, ""))
        self.last_usage = delta.usage
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": "".join(pieces)}]


def chat_in_terminal(engine: Engine, config: GenerationConfig) -> None:
    TerminalChat(engine, config).run()
