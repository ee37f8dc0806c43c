"""Turn a public GenerateRequest into a scheduler Request, or say precisely which field is wrong.

Everything a client sends crosses a process boundary, so every field is checked here before
anything touches the scheduler: a bad request costs the client an INVALID_ARGUMENT, never the
server its state.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from chunkwise.plan import SamplingParams
from chunkwise.v1 import generation_pb2 as gpb

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_PROMPT_CHARS = 4 * 1024 * 1024
# Tokenizing runs on the event loop, so text far longer than any prompt that could fit is refused
# before it is tokenized. No real tokenizer averages anywhere near this many characters a token.
MAX_CHARS_PER_TOKEN = 64
DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class ParsedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    cache_salt: str | None
    arrival_time: float


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"must be a finite number, got {value}")
    return value


def _need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise InvalidRequest(
            "prompt", "this server has no tokenizer (start it with --tokenizer); send token_ids instead"
        )


def parse_generate_request(
    msg: gpb.GenerateRequest, tokenizer, vocab_size: int, max_model_len: int
) -> ParsedRequest:
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequest("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")

    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "one of text, token_ids or messages is required")
    max_chars = min(MAX_PROMPT_CHARS, max_model_len * MAX_CHARS_PER_TOKEN)
    if kind == "text":
        if not msg.text:
            raise InvalidRequest("prompt.text", "must not be empty")
        if len(msg.text) > max_chars:
            raise InvalidRequest("prompt.text", f"longer than {max_chars} characters")
        _need_tokenizer(tokenizer)
        try:
            ids = list(tokenizer(msg.text).input_ids)
        except Exception as e:  # the tokenizer is third-party code; any failure is about this text
            raise InvalidRequest("prompt.text", f"could not be tokenized: {e}") from None
    elif kind == "messages":
        if not msg.messages.messages:
            raise InvalidRequest("prompt.messages", "must not be empty")
        messages = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
        if sum(len(m["content"]) + len(m["role"]) for m in messages) > max_chars:
            raise InvalidRequest("prompt.messages", f"longer than {max_chars} characters")
        _need_tokenizer(tokenizer)
        from chunkwise.model_source import apply_chat_template

        try:
            ids = apply_chat_template(tokenizer, messages)
        except Exception as e:  # ValueError from us, or the template's own (jinja) errors
            raise InvalidRequest("prompt.messages", str(e)) from None
    else:
        token_ids = msg.token_ids.ids
        # Length first: it is O(1), and a long list is refused before it is copied.
        if len(token_ids) >= max_model_len:
            raise InvalidRequest(
                "prompt.token_ids",
                f"{len(token_ids)} tokens leave no room for output within max_model_len ({max_model_len})",
            )
        ids = list(token_ids)
        if ids and max(ids) >= vocab_size:
            bad = next(t for t in ids if t >= vocab_size)
            raise InvalidRequest("prompt.token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise InvalidRequest(f"prompt.{kind}", "must contain at least one token")
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt.{kind}", f"{len(ids)} tokens leave no room for output within max_model_len ({max_model_len})"
        )

    s = msg.sampling
    temperature = _finite("sampling.temperature", s.temperature) if s.HasField("temperature") else 1.0
    if temperature < 0:
        raise InvalidRequest("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = _finite("sampling.top_p", s.top_p) if s.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = s.top_k if s.HasField("top_k") else -1
    if top_k < -1:
        raise InvalidRequest("sampling.top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {top_k}")
    min_p = _finite("sampling.min_p", s.min_p) if s.HasField("min_p") else 0.0
    if not 0 <= min_p <= 1:
        raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {min_p}")
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    if len(ids) + max_tokens > max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})",
        )
    num_logprobs = s.logprobs if s.HasField("logprobs") else None
    if num_logprobs is not None and num_logprobs > MAX_LOGPROBS:
        raise InvalidRequest("sampling.logprobs", f"must be at most {MAX_LOGPROBS}, got {num_logprobs}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    if any(len(x) > MAX_STOP_STRING_CHARS for x in s.stop):
        raise InvalidRequest("sampling.stop", f"each stop string at most {MAX_STOP_STRING_CHARS} characters")
    if any(not x for x in s.stop):
        raise InvalidRequest("sampling.stop", "stop strings must not be empty")
    if s.stop and tokenizer is None:
        raise InvalidRequest("sampling.stop", "stop strings need a tokenizer; use stop_token_ids")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    bad = next((t for t in s.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("sampling.stop_token_ids", f"token id {bad} is outside the vocabulary")
    if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters")

    sampling = SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        seed=s.seed if s.HasField("seed") else None,
        num_logprobs=num_logprobs,
    )
    return ParsedRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        cache_salt=msg.cache_salt or None,
        arrival_time=time.monotonic(),
    )
