"""Text generation over a compiled model: the API behind `kiln generate`, `kiln chat` and the server.

One `Engine` owns one model and one KV cache sequence, and runs one generation at a time: a second
caller waits up to `busy_timeout_s` (default 0) and then gets `EngineBusy`. A stream holds the
engine from the call that creates it until it is exhausted or closed.

Every generation reuses the longest prefix of its prompt that is still in the KV cache and
prefills only the rest. Chat turns build their prompt from the previous turn's exact token ids
plus the newly rendered text, so a turn that extends the last conversation prefills only its
new tokens even when the model's reply would tokenize differently on its own.

Tokens are chosen by `kiln.sampling.Sampler` (the same definition as the browser engine's), and
turned into text by `kiln.text` (deltas that never split a character, stop strings).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kiln.chat_template import ChatTemplate
from kiln.completions import ChatCompletionRequest, CompletionRequest, Reply, collected
from kiln.errors import KilnError
from kiln.model_folder import read_json
from kiln.runtime import NativeModel, reusable_prefix
from kiln.sampling import Sampler
from kiln.speculative import METHODS, OFF, DraftModel, Speculation, check_same_vocabulary, decoding_steps
from kiln.structured import GrammarCompiler, ResponseFormat, TokenConstraint
from kiln.text import StopStrings, TextStream, load_tokenizer
from kiln.tools import ContentBeforeCalls, ToolCallFormat, messages_for_template, tool_call_format


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logits_top_k: int = 0  # >0: record the top-K logits of every step
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None  # None: free text
    speculative: str | None = None  # "prompt-lookup", "draft" or "off"; None: the engine's own (kiln.speculative)

    def check(self) -> None:
        problems = [
            (self.max_tokens < 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature < 0, f"temperature must be 0 (greedy) or positive, got {self.temperature}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k < 0, f"top_k must be 0 (off) or positive, got {self.top_k}"),
            (self.repetition_penalty <= 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (self.logits_top_k < 0, f"logits_top_k must be 0 (off) or positive, got {self.logits_top_k}"),
            (self.seed is not None and self.seed < 0, f"seed must be 0 or positive, got {self.seed}"),
            (
                self.speculative not in (None, OFF, *METHODS),
                f"speculative must be one of {', '.join((OFF, *METHODS))}, got {self.speculative!r}",
            ),
        ]
        for failed, problem in problems:
            if failed:
                raise KilnError(problem)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prefilled_tokens: int  # tokens actually prefilled this call (the rest came from the cache)
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    total_s: float
    mask_ms_per_token: float = 0.0  # computing a response format's token mask, per generated token
    model_steps: int = 0  # model passes after the prompt's prefill: decode steps, or verify passes
    proposed_tokens: int = 0  # speculative decoding: tokens proposed and verified
    accepted_tokens: int = 0  # of those, the ones the reply took


@dataclass
class Delta:
    """One streamed piece of a generation."""

    text: str  # never splits a multi-byte character
    token_ids: list[int]  # tokens generated since the previous delta
    finish_reason: str | None = None  # "stop" | "length" | "abort" (interrupted, as WebLLM says) on the last delta
    usage: Usage | None = None  # on the last delta
    logits: list[dict] | None = None  # with logits_top_k: one record per token in token_ids


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]  # includes the EOS token that ended the generation, if one did
    text: str  # excludes the EOS token and anything from a stop string on
    finish_reason: str
    usage: Usage
    logits: list[dict] | None = None  # per step {"token_ids": [...], "logits": [...]} when logits_top_k

    def to_json(self) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": asdict(self.usage),
        }
        if self.logits is not None:
            out["logits"] = self.logits
        return out


class EngineError(KilnError):
    """A request the engine refuses, with one of the codes all three engines share
    (ERROR_CODES, the browser engine's web/src/errors.js)."""

    def __init__(self, code: str, problem: str):
        super().__init__(problem)
        self.code = code


# The codes of web/src/errors.js that the native engine gives (a test holds the two lists together).
ERROR_CODES = ("bad-request", "no-chat-template", "no-tool-support", "busy", "context-window-exceeded")


class EngineBusy(EngineError):
    """Another generation is running on this engine."""

    def __init__(self, problem: str):
        super().__init__("busy", problem)


def acquire_or_busy(lock: threading.Lock, timeout_s: float, busy: str) -> None:
    """Take an engine's `lock`, waiting up to `timeout_s` (0: not at all); else EngineBusy(`busy`)."""
    acquired = lock.acquire(timeout=timeout_s) if timeout_s > 0 else lock.acquire(blocking=False)
    if not acquired:
        raise EngineBusy(busy)


@dataclass
class Conversation:
    """The last chat turn as rendered text and the exact token ids the model saw or produced."""

    text: str
    token_ids: list[int]


class Engine:
    """A compiled model ready to generate: `tokenizer` (the `tokenizers` library on tokenizer.json),
    `chat_template` (None for a base model), `model_id`, `chat_config` (mlc-chat-config.json) and
    `model` (the runtime under it)."""

    def __init__(
        self,
        model_dir: Path,
        target: str = "cpu",
        busy_timeout_s: float = 0.0,
        model=None,
        speculation: Speculation | None = None,
    ):
        """`model` replaces the native runtime with another of its interface (a BrowserModel);
        `speculation`: how replies are decoded speculatively unless a request says otherwise
        (a draft model is loaded here, on the same target)."""
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.chat_template = ChatTemplate.find(self.model_dir)
        self.model = model or NativeModel(self.model_dir, target)
        self.chat_config = self.model.chat_config
        build = read_json(self.model_dir / "kiln-build.json")
        self.model_id = build.get("model_id", self.model_dir.name)
        conv = self.chat_config.get("conv_template") or {}
        self.eos_token_ids = set(self.chat_config.get("eos_token_id") or []) | set(conv.get("stop_token_ids") or [])
        self.chat_stop_strings = list(conv.get("stop_str") or [])
        marks = self.tool_call_format.marks if self.tool_call_format else ()
        self.grammars = GrammarCompiler(
            self.tokenizer, self.chat_config, self.model.vocab_size, self.eos_token_ids, marks
        )
        self.busy_timeout_s = busy_timeout_s
        self.speculation = speculation
        self.draft = self._load_draft(target) if speculation else None
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._generations = 0  # generations started: what an `interrupter` is bound to
        self._interrupt_lock = threading.Lock()
        self.last_active = time.monotonic()  # when the last generation ended (or the engine loaded)
        self._cached_ids: list[int] = []
        self._conversation: Conversation | None = None
        self.tokens_generated = 0  # by the running generation, or the last one

    # Prompts

    def encode(self, text: str) -> list[int]:
        """A raw prompt's ids, with the tokenizer's own special tokens (as `transformers` does)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def require_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise KilnError(
                "this model has no chat template (a base model): it completes raw text, it does not chat",
                self.model_dir,
            )
        return self.chat_template

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The conversation as the chat template writes it; with `tools` (OpenAI's), showing them to the model."""
        template = self.require_chat_template()
        check_messages(messages)
        return template.render(messages_for_template(messages), add_generation_prompt, tools)

    @property
    def tool_call_format(self) -> ToolCallFormat | None:
        """How this model writes a tool call, when its chat template renders tools."""
        return tool_call_format(self.chat_template.source) if self.chat_template else None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False).ids

    # Generation

    def stream(self, prompt: str | list[int], config: GenerationConfig) -> Iterator[Delta]:
        """Complete a raw prompt (text, or token ids as they are)."""
        return self._start(self._raw_prompt_ids(prompt), config, list(config.stop), conversation_text=None)

    def stream_chat(
        self, messages: list[dict], config: GenerationConfig, tools: list[dict] | None = None, reply_opening: str = ""
    ) -> Iterator[Delta]:
        """Reply to a conversation; stops also at the conversation template's stop strings. `tools`
        are shown to the model; `reply_opening` is written after the generation prompt, as the
        start of the reply the model continues (it is not in the deltas)."""
        prompt_ids, text = self._chat_prompt_ids(messages, tools, reply_opening)
        return self._start(prompt_ids, config, [*config.stop, *self.chat_stop_strings], conversation_text=text)

    def generate(self, prompt: str | list[int], config: GenerationConfig) -> GenerationResult:
        prompt_ids = self._raw_prompt_ids(prompt)
        return collect(prompt_ids, self._start(prompt_ids, config, list(config.stop), conversation_text=None))

    def generate_chat(
        self, messages: list[dict], config: GenerationConfig, tools: list[dict] | None = None, reply_opening: str = ""
    ) -> GenerationResult:
        prompt_ids, text = self._chat_prompt_ids(messages, tools, reply_opening)
        stops = [*config.stop, *self.chat_stop_strings]
        return collect(prompt_ids, self._start(prompt_ids, config, stops, conversation_text=text))

    # OpenAI's completions, as the browser engine's chatCompletion gives them (kiln/completions.py)

    def chat_completion(self, request: ChatCompletionRequest) -> dict:
        return collected(self.chat_completion_chunks(request))

    def chat_completion_chunks(self, request: ChatCompletionRequest) -> Iterator[dict]:
        """The reply's `chat.completion.chunk`s; the generation starts (and the engine is taken) at
        this call, so a request the engine refuses fails here rather than mid-stream."""
        return Reply(True, request.model).chunks(*self._chat_reply(request))

    def completion(self, request: CompletionRequest) -> dict:
        return collected(self.completion_chunks(request))

    def completion_chunks(self, request: CompletionRequest) -> Iterator[dict]:
        return Reply(False, request.model).chunks(self.stream(request.prompt, request.config), None)

    def _chat_reply(self, request: ChatCompletionRequest) -> tuple[Iterator[Delta], ContentBeforeCalls | None]:
        """A chat's started stream, and what reads tool calls out of it when the model may call one."""
        if self.chat_template is None:
            raise EngineError(
                "no-chat-template",
                f"The model {request.model!r} has no chat template (it is a base model): it completes raw text, "
                "it does not chat.",
            )
        tools = request.tools if request.tools and request.tools.choice != "none" else None
        if tools is None:
            return self.stream_chat(request.messages, request.config), None
        call_format = self.tool_call_format
        if call_format is None:
            raise EngineError(
                "no-tool-support",
                f"The model {request.model!r} cannot call tools: its chat template does not render them "
                "(or writes calls in a way Kiln does not read).",
            )
        config = replace(request.config, response_format=tools.response_format(call_format))
        opening = tools.reply_opening(call_format)
        deltas = self.stream_chat(request.messages, config, tools.tools, opening)
        return deltas, ContentBeforeCalls(call_format, tools.functions, opening)

    @property
    def busy(self) -> bool:
        """Whether a generation holds the engine."""
        return self._lock.locked()

    def interrupt(self) -> None:
        """End the running generation after its current step (finish_reason "abort")."""
        self._interrupted.set()

    def interrupter(self) -> Callable[[], None]:
        """`interrupt`, for the generation running now only: called after it ends (once another has
        taken the engine), it does nothing."""
        with self._interrupt_lock:
            generation = self._generations

        def interrupt() -> None:
            with self._interrupt_lock:
                if self._generations == generation:
                    self._interrupted.set()

        return interrupt

    def reset(self) -> None:
        """Forget the KV cache and the conversation."""
        self._acquire()
        try:
            self._forget()
        finally:
            self._lock.release()

    def _raw_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def _chat_prompt_ids(
        self, messages: list[dict], tools: list[dict] | None = None, reply_opening: str = ""
    ) -> tuple[list[int], str]:
        text = self.render_chat(messages, tools=tools) + reply_opening
        previous = self._conversation
        if previous is not None and text.startswith(previous.text):
            new_ids = self.tokenizer.encode(text[len(previous.text) :], add_special_tokens=False).ids
            return previous.token_ids + new_ids, text
        return self.tokenizer.encode(text, add_special_tokens=False).ids, text

    def _load_draft(self, target: str) -> DraftModel | None:
        self.speculation.check()
        if self.speculation.draft is None:
            return None
        draft_dir = self.speculation.draft
        check_same_vocabulary(self.tokenizer, load_tokenizer(draft_dir), draft_dir)
        model = NativeModel(draft_dir, target)
        return DraftModel(model, min(model.vocab_size, self.model.vocab_size))

    def _speculation_for(self, config: GenerationConfig) -> Speculation | None:
        """The request's own speculative method, else the engine's."""
        if config.speculative is None:
            return self.speculation
        if config.speculative == OFF:
            return None
        if config.speculative == "draft" and self.draft is None:
            raise EngineError("bad-request", 'speculative "draft" needs an engine that loaded a draft model')
        base = self.speculation or Speculation(config.speculative)
        return replace(base, method=config.speculative)

    def _forget(self) -> None:
        self.model.reset()
        if self.draft:
            self.draft.reset()
        self._cached_ids = []
        self._conversation = None

    def _acquire(self) -> None:
        busy = f"the engine for {self.model_id} is busy with another generation"
        acquire_or_busy(self._lock, self.busy_timeout_s, busy)

    def _start(
        self, prompt_ids: list[int], config: GenerationConfig, stops: list[str], conversation_text: str | None
    ) -> Iterator[Delta]:
        config.check()
        self._check_prompt(prompt_ids)
        speculation = self._speculation_for(config)
        # Compiled before the engine is taken: a bad schema is the caller's error, found at once.
        constraint = config.response_format and self.grammars.constraint(config.response_format)
        generation = self._generation(prompt_ids, config, stops, conversation_text, constraint, speculation)
        # Run up to the first yield: the engine is taken now, so a busy engine fails at this call
        # rather than mid-stream, and a started generator releases it when closed or collected.
        next(generation)
        return generation

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise KilnError("the prompt is empty")
        window = self.model.context_window_size
        if len(prompt_ids) > window:
            raise EngineError(
                "context-window-exceeded",
                f"the prompt has {len(prompt_ids)} tokens, more than the context window of {window}",
            )
        vocab = self.model.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise KilnError(f"prompt token ids must be in [0, {vocab})")

    def _prefill(self, prompt_ids: list[int]) -> tuple[np.ndarray | None, int]:
        """Bring the cache to `prompt_ids`: keep the common prefix, prefill the rest chunk by chunk.
        Returns the last logits (None when interrupted) and how many tokens were prefilled."""
        common = reusable_prefix(self._cached_ids, prompt_ids)
        common = self.model.rollback(len(self._cached_ids) - common)
        del self._cached_ids[common:]
        logits = None
        chunk_size = self.model.prefill_chunk_size
        for start in range(common, len(prompt_ids), chunk_size):
            if self._interrupted.is_set():
                return None, len(self._cached_ids) - common
            chunk = prompt_ids[start : start + chunk_size]
            logits = self.model.prefill(chunk)
            self._cached_ids.extend(chunk)
        return logits, len(prompt_ids) - common

    def _generation(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        stops: list[str],
        conversation_text: str | None,
        constraint: TokenConstraint | None,
        speculation: Speculation | None,
    ) -> Iterator[Delta]:
        self._acquire()
        try:
            with self._interrupt_lock:
                self._generations += 1
                self._interrupted.clear()
            yield  # primed by _start
            yield from self._run(prompt_ids, config, stops, conversation_text, constraint, speculation)
        except GeneratorExit:
            raise
        except BaseException:
            # A step may have stopped halfway (e.g. Ctrl-C inside the VM call): distrust the cache.
            self._forget()
            raise
        finally:
            self.last_active = time.monotonic()
            self._lock.release()

    def _run(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        stops: list[str],
        conversation_text: str | None,
        constraint: TokenConstraint | None,
        speculation: Speculation | None,
    ) -> Iterator[Delta]:
        started = time.perf_counter()
        self.tokens_generated = 0
        logits, prefilled = self._prefill(prompt_ids)
        prefill_s = time.perf_counter() - started
        sampler = Sampler(config, prompt_ids)
        steps = decoding_steps(self.model, speculation, self.draft, prompt_ids, constraint)
        text_stream = TextStream(self.tokenizer, prompt_ids)
        stop_strings = StopStrings(stops)
        tokens: list[int] = []
        unsent_ids: list[int] = []
        unsent_logits: list[dict] = []
        reply: list[str] = []
        final_text = ""
        first_token_at = None
        finish = "abort" if logits is None else None
        hit_stop_string = False
        while finish is None:
            if config.logits_top_k:
                unsent_logits.append(top_logits(logits, config.logits_top_k))
            token = sampler.sample(logits, constraint.allowed() if constraint else None)
            last_token_at = time.perf_counter()
            first_token_at = first_token_at or last_token_at
            tokens.append(token)
            self.tokens_generated = len(tokens)
            unsent_ids.append(token)
            sampler.record(token)
            if constraint:
                constraint.accept(token)
            # A finished format allows nothing more, so its stop token ends the reply even with ignore_eos.
            if token in self.eos_token_ids and (not config.ignore_eos or (constraint and constraint.finished)):
                finish = "stop"
                break
            piece, hit_stop_string = stop_strings.feed(text_stream.add(token))
            if hit_stop_string:
                finish = "stop"
            elif len(tokens) >= config.max_tokens or len(self._cached_ids) >= self.model.context_window_size:
                finish = "length"
            elif self._interrupted.is_set():
                finish = "abort"
            if finish is not None:
                final_text = piece
                break
            if piece:
                reply.append(piece)
                yield Delta(piece, unsent_ids, logits=unsent_logits if config.logits_top_k else None)
                unsent_ids, unsent_logits = [], []
            logits = steps.logits_after(token)
            self._cached_ids.append(token)
        steps.settle()
        if not hit_stop_string:
            tail, hit_stop_string = stop_strings.feed(text_stream.flush())
            final_text += tail if hit_stop_string else tail + stop_strings.flush()
            finish = "stop" if hit_stop_string else finish
        reply.append(final_text)
        if conversation_text is not None:
            self._remember_conversation(conversation_text, prompt_ids, tokens, "".join(reply))
        ended = time.perf_counter()
        # README, "Benchmarks": tokens after the first ÷ the time from the first to the last, sampling included.
        decode_s = last_token_at - first_token_at if first_token_at else 0.0
        usage = Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(tokens),
            prefilled_tokens=prefilled,
            ttft_s=(first_token_at or ended) - started,
            prefill_tokens_per_s=prefilled / prefill_s if prefill_s > 0 else 0.0,
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0,
            total_s=ended - started,
            mask_ms_per_token=1000 * constraint.mask_s / constraint.steps if constraint and constraint.steps else 0.0,
            model_steps=steps.stats.steps,
            proposed_tokens=steps.stats.proposed,
            accepted_tokens=steps.stats.accepted,
        )
        yield Delta(final_text, unsent_ids, finish, usage, logits=unsent_logits if config.logits_top_k else None)

    def _remember_conversation(self, text: str, prompt_ids: list[int], tokens: list[int], reply: str) -> None:
        reply_ids = tokens[:-1] if tokens and tokens[-1] in self.eos_token_ids else tokens
        if self.tokenizer.decode(reply_ids, skip_special_tokens=False) != reply:
            reply_ids = self.tokenizer.encode(reply, add_special_tokens=False).ids
        self._conversation = Conversation(text + reply, prompt_ids + reply_ids)


def top_logits(logits: np.ndarray, k: int) -> dict:
    top = np.argsort(-logits, kind="stable")[:k]
    return {"token_ids": top.tolist(), "logits": logits[top].tolist()}


def collect(prompt_ids: list[int], deltas: Iterator[Delta]) -> GenerationResult:
    texts, tokens, logits = [], [], []
    for delta in deltas:
        texts.append(delta.text)
        tokens.extend(delta.token_ids)
        logits.extend(delta.logits or [])
        last = delta
    return GenerationResult(
        prompt_ids, tokens, "".join(texts), last.finish_reason, last.usage, logits if last.logits is not None else None
    )


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise KilnError("the conversation is empty: give at least one message")
    for i, message in enumerate(messages):
        calls_tools = isinstance(message, dict) and message.get("tool_calls") and message.get("content") is None
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not (isinstance(message.get("content"), str) or calls_tools)
        ):
            raise KilnError(
                f"message {i} needs a string 'role' and a string 'content' (or tool_calls), got {message!r}"
            )
