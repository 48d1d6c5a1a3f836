"""Structured outputs in the engine process: grammars compiled with xgrammar, one matcher per
constrained request, and each step's token bitmasks.

Every constraint (contract/structured.py) becomes one xgrammar structural tag: an optional reasoning
block (free text up to `</think>`, when the prompt opened one) followed by the constraint proper:
a JSON schema, a regex, a choice of strings, an EBNF grammar, a structural tag of the client's, or the
model's DSML tool-call syntax (xgrammar's built-in DeepSeek-V4 / V4.1 tags: the arguments follow each
tool's JSON schema, string arguments raw). So the grammar applies after the reasoning ends, and a
forced tool call always parses into the requested call.

Compiling can take a while (a large schema: tens of ms to seconds), so it runs on this module's
threads, never the engine loop's, with a cache keyed by the constraint: the front end asks for a
compile first (CheckGrammar, so a bad schema is the client's 400 before any stream starts) and the
request that follows finds it compiled. The matchers live on the engine thread: before a step the
loop asks for the bitmask of every drawing constrained request (`bitmasks`), after it feeds the drawn
tokens (`accept`). Once the grammar is complete only the stop tokens are allowed, so the request ends
as any other does, at its eos. Matchers can roll back tokens (xgrammar keeps the history), which is
what speculative decoding's rejected drafts will need.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract import StructuredOutput

log = logging.getLogger("ds4serve.structured")

COMPILE_THREADS = 2
CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_TIMEOUT_S = 60.0  # a request whose grammar takes longer fails (not the engine)
THINK_START, THINK_END = "<think>", "</think>"
# config.json model_type -> xgrammar's built-in tool-call structural tag
TOOL_CALL_FORMATS = {"deepseek_v4": "deepseek_v4", "deepseek_v41": "deepseek_v4_1", "deepseek_v41_text": "deepseek_v4_1"}


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; the message is for the client."""


@dataclass(frozen=True)
class GrammarVocabulary:
    """What a grammar is compiled against: the checkpoint's tokenizer, the logits' width (the model's
    vocabulary, which may exceed the tokenizer's), the stop tokens allowed once a grammar is complete,
    and the model type (which DSML tool-call dialect)."""

    tokenizer_file: Path
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    model_type: str


class StructuredOutputs:
    """The engine's grammars: compile (off the loop thread, cached), match, bitmask."""

    def __init__(self, vocabulary: GrammarVocabulary) -> None:
        self.vocabulary = vocabulary
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="ds4serve-grammar")
        # the tokenizer's grammar info takes seconds (xgrammar, transformers, the vocabulary scan): made
        # by the first compile, on a compile thread, so servers that never constrain never pay for it
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._compiled: OrderedDict[tuple, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._requests: dict[str, _Constrained] = {}

    # -- compiling (any thread) ---------------------------------------------------------------------
    def check(self, structured: StructuredOutput, reply: Callable[[str | None], None]) -> None:
        """Compiles `structured` and calls reply(None), or reply(why it cannot compile), from a
        compile thread."""
        def done(future: Future[Any]) -> None:
            error = future.exception()
            reply(None if error is None else _client_message(error))

        self._compile(structured).add_done_callback(done)

    def _compile(self, structured: StructuredOutput) -> Future[Any]:
        with self._lock:
            future = self._compiled.get(structured.key)
            if future is None or _failed_for_another_reason(future):
                future = self._pool.submit(self._compile_now, structured)
                self._compiled[structured.key] = future
            self._compiled.move_to_end(structured.key)
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def _compile_now(self, structured: StructuredOutput) -> Any:
        compiler = self._grammar_compiler()
        tag = structural_tag(structured, self.vocabulary.model_type)
        try:
            return compiler.compile_structural_tag(tag)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise GrammarError(f"{structured.param}: cannot compile the constraint: {exc}") from exc

    def _grammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.vocabulary.tokenizer_file))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocabulary.vocab_size,
                                                          stop_token_ids=list(self.vocabulary.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
            return self._compiler

    # -- matching (the engine thread) ---------------------------------------------------------------
    def add(self, request_id: str, structured: StructuredOutput) -> None:
        self._requests[request_id] = _Constrained(self._compile(structured), self.vocabulary.vocab_size)

    def constrained(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def any_constrained(self) -> bool:
        """Whether any request holds a matcher (the loop skips its per-step pass when none does)."""
        return bool(self._requests)

    def bitmask(self, request_id: str) -> tuple[int, ...]:
        """The next draw's allowed tokens as int32 words (ScheduledChunk.token_bitmask). Raises
        GrammarError if the request's grammar did not compile."""
        return self._requests[request_id].bitmask()

    def accept(self, request_id: str, token_ids: Sequence[int]) -> str | None:
        """Advances the request's matcher; returns why a token was refused (None: all accepted)."""
        constrained = self._requests.get(request_id)
        return None if constrained is None else constrained.accept(token_ids)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Constrained:
    """One request's matcher, made when its grammar is compiled (on first use)."""

    def __init__(self, compiled: Future[Any], vocab_size: int) -> None:
        self._compiled, self._vocab_size = compiled, vocab_size
        self._matcher: Any = None
        self._words: Any = None

    def _ready(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr

            try:
                grammar = self._compiled.result(COMPILE_TIMEOUT_S)
            except TimeoutError as exc:
                raise GrammarError(f"the grammar did not compile within {COMPILE_TIMEOUT_S:.0f} s") from exc
            self._matcher = xgr.GrammarMatcher(grammar)
            self._words = xgr.allocate_token_bitmask(1, self._vocab_size)
        return self._matcher

    def bitmask(self) -> tuple[int, ...]:
        matcher = self._ready()
        matcher.fill_next_token_bitmask(self._words, 0)
        return tuple(self._words[0].tolist())

    def accept(self, token_ids: Sequence[int]) -> str | None:
        matcher = self._ready()
        for token in token_ids:
            if matcher.is_terminated():
                return None  # the stop token that ended the grammar; nothing may follow it
            if not matcher.accept_token(token):
                return f"the grammar refused token {token}"
        return None


def structural_tag(structured: StructuredOutput, model_type: str) -> Any:
    """The xgrammar StructuralTag for a constraint (raises GrammarError for a malformed spec)."""
    from xgrammar import structural_tag as st
    from xgrammar.builtin_structural_tag import get_model_structural_tag

    kind, spec = structured.kind, structured.spec
    # compact: JSON with no whitespace (vLLM's disable_any_whitespace), through xgrammar's own schema
    # converter; the DSML call syntax takes a whitespace count, at least 1 (one character in a row)
    whitespace = None if structured.any_whitespace else 1
    try:
        if kind == "tool_call":
            tools = json.loads(spec)
            if model_type not in TOOL_CALL_FORMATS:
                raise GrammarError(f"tool_choice: no tool-call grammar for model type {model_type!r}")
            return get_model_structural_tag(
                TOOL_CALL_FORMATS[model_type], tools=tools["tools"], tool_choice=tools["tool_choice"],
                reasoning="enabled" if structured.reasoning else "disabled",
                parallel_tool_calls=tools["parallel_tool_calls"], max_whitespace_cnt=whitespace,
            )
        if kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if kind == "json_object" else json.loads(spec)
            body: Any = _json_format(schema, structured.any_whitespace)
        elif kind == "regex":
            body = st.RegexFormat(pattern=spec)
        elif kind == "choice":
            body = st.OrFormat(elements=[st.ConstStringFormat(value=choice) for choice in json.loads(spec)])
        elif kind == "grammar":
            body = st.GrammarFormat(grammar=spec)
        else:
            assert kind == "structural_tag", kind
            body = st.StructuralTag.from_json(spec).format
    except GrammarError:
        raise
    except Exception as exc:  # pydantic's ValidationError, JSON errors: the spec's shape is wrong
        raise GrammarError(f"{structured.param}: {exc}") from exc
    if structured.reasoning:
        thinking = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=[THINK_START, THINK_END]), end=THINK_END)
        body = st.SequenceFormat(elements=[thinking, body])
    return st.StructuralTag(format=body)


def _json_format(schema: Any, any_whitespace: bool) -> Any:
    from xgrammar import Grammar
    from xgrammar import structural_tag as st

    if any_whitespace:
        return st.JSONSchemaFormat(json_schema=schema)
    return st.GrammarFormat(grammar=str(Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)))


def _client_message(error: BaseException) -> str:
    return str(error) if isinstance(error, GrammarError) else f"cannot compile the constraint: {error}"


def _failed_for_another_reason(future: Future[Any]) -> bool:
    """A compile that failed for another reason than the constraint (cancelled, the compiler could
    not start) is tried again; a constraint that does not compile stays cached as such."""
    if not future.done():
        return False
    if future.cancelled():
        return True
    error = future.exception()
    return error is not None and not isinstance(error, GrammarError)
