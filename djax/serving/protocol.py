"""The OpenAI wire format of `POST /v1/completions` and `POST /v1/chat/completions`: request
bodies (validated strictly: a wrong type is refused, never coerced), responses, stream
chunks and error bodies.

`n` asks for up to `MAX_CHOICES` answers to each prompt (completions take a batch of up to
`MAX_PROMPTS`): each runs as a row of its own, choice i with the seed `seed + i` (mod
`SEED_LIMIT`). Fields OpenAI defines that djax cannot honour (`logprobs`, `best_of` > 1,
`echo`, `suffix`, tools and functions, a `response_format` other than text) are refused
with a 400 naming the field, as are the sampling controls djax does not apply (OpenAI's
`frequency_penalty`, `presence_penalty`, `logit_bias`, and the `min_p` and
`repetition_penalty` other servers take) unless they hold their neutral value
(`SAMPLING_CONTROLS`): a request must not silently get other sampling than it asked for.
`top_p` (in (0, 1]) and `top_k` (an int ≥ 1; 0 and -1 mean none, as other servers take them)
limit a sampled token to the most likely ones (`djax.decoders.Filters`); a `temperature`
below `djax.generation.GREEDY_BELOW` decodes greedily. vLLM's and SGLang's fields that
change the answer (`stop_token_ids`, `min_tokens`, guided decoding and grammars,
`allowed_token_ids`, `continue_final_message`, ...: `SERVER_CONTROLS`,
`SERVER_CHAT_CONTROLS`) are refused unless neutral, and `stream_options` without `stream`.
Other fields it does not know are ignored. djax's own fields: `threshold`
(τ of the threshold decoder) and `ignore_eos` (keep denoising past stop tokens up to
max_tokens); vLLM's `priority` (an int, default 0) orders the waiting requests, lower first,
where the server runs `--scheduling-policy priority` (elsewhere another value than 0 is
refused, as vLLM refuses it).
"""

from __future__ import annotations

import json
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from djax import prompt_io
from djax.generation import GREEDY_BELOW

MAX_STOP_STRINGS = 4
MAX_CHOICES = 16  # `n`
MAX_PROMPTS = 64  # a completions request's batch
PROMPT_TYPES = "expected a string, a list of token ids, or a list of those"
SEED_LIMIT = 2**32  # seeds are in [0, SEED_LIMIT)
BODY_BYTES_PER_TOKEN = 32  # `body_limit`: generous for text (~4 bytes a token) and ids
# pydantic's own error kinds, whose messages say what was expected but not what was sent
# (`parse` adds it); djax's own (`_refuse`) write the value where it helps
_PYDANTIC_ERRORS = frozenset(typing.get_args(core_schema.ErrorType)) - {"missing"}

FinishReason = Literal["stop", "length"]

# vLLM's and SGLang's request fields that change the answer, which djax does not apply,
# each with the values that leave it as djax answers (None, the field left out, too):
# another value is refused. `prompt_logprobs` has none: vLLM returns the prompt's
# log-probabilities for any value, 0 included.
SERVER_CONTROLS: dict[str, tuple[Any, ...]] = {
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "prompt_logprobs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "use_beam_search": (False,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "add_special_tokens": (True,),  # completions tokenise with the tokenizer's specials
    "regex": (),  # SGLang's constrained decoding
    "json_schema": (),
    "ebnf": (),
    "no_stop_trim": (False,),
    "stop_regex": ([],),  # SGLang: ends the answer at a regex match
    "logits_processors": ([],),  # vLLM: processors applied to each step's logits
    "lora_path": (),  # SGLang: answers with a LoRA adapter
    "custom_logit_processor": (),  # SGLang
}
# The chat endpoint's too (over the above where both name a field).
SERVER_CHAT_CONTROLS: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": ([],),
    "add_special_tokens": (False,),  # the chat template writes the specials itself
}

# Sampling controls djax does not apply, each with the values that leave sampling as it is
# (None, the field left out, too): a request holding another value is refused.
SAMPLING_CONTROLS: dict[str, tuple[float, ...]] = {
    "min_p": (0,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
}


class ProtocolError(Exception):
    """A request the server refuses, as an OpenAI error: HTTP status, error type, the
    request field at fault (`param`, dotted) and a machine-readable `code`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.kind, param=self.param, code=self.code
            )
        ).model_dump()


def _refuse(kind: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, message, context)


def _too_many(kind: str, n: int, what: str, limit: int) -> PydanticCustomError:
    return _refuse(kind, "holds {n} {what}; expected at most {limit}", n=n, what=what, limit=limit)


def _unsupported(field: str, what: str) -> PydanticCustomError:
    return _refuse("unsupported", f"{field} is not supported: {what}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    # vLLM's and SGLang's: with include_usage, every chunk also carries its choice's usage
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: tuple[str, ...] = ()
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    threshold: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    ignore_eos: bool = False
    priority: int | None = None  # vLLM's; None: 0
    n: int = 1
    logprobs: Any = None
    top_logprobs: Any = None
    best_of: Any = None
    echo: Any = False
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # the device holds it as int32
    min_p: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None

    @field_validator("stream", mode="before")
    @classmethod
    def _stream_null(cls, value: Any) -> Any:
        return False if value is None else value  # null: OpenAI's default, no stream

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop_strings(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        strings = [value] if isinstance(value, str) else value
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise _refuse("stop_type", "expected a string or a list of strings")
        if len(strings) > MAX_STOP_STRINGS:
            raise _too_many("stop_count", len(strings), "strings", MAX_STOP_STRINGS)
        if not all(strings):
            raise _refuse("stop_empty", "holds an empty string; stop strings must be non-empty")
        return tuple(strings)

    @field_validator("n", mode="plain")
    @classmethod
    def _choices(cls, value: Any) -> int:
        if value is None:
            return 1
        if type(value) is not int or not 1 <= value <= MAX_CHOICES:
            raise _refuse(
                "choices",
                "n={n}; expected an integer from 1 to {limit}",
                n=json.dumps(value, default=str),  # as the client wrote it
                limit=MAX_CHOICES,
            )
        return value

    @field_validator("logprobs", mode="plain")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        # completions' `logprobs: 0` asks for the sampled tokens' own log-probabilities
        if value is not None and value is not False:
            raise _unsupported("logprobs", "djax returns no log-probabilities")
        return None

    @field_validator("top_logprobs", mode="plain")
    @classmethod
    def _no_top_logprobs(cls, value: Any) -> Any:
        if value is not None and not (type(value) is int and value == 0):
            raise _unsupported("top_logprobs", "djax returns no log-probabilities")
        return None

    @field_validator("temperature")
    @classmethod
    def _greedy_below(cls, value: float | None) -> float | None:
        return 0.0 if value is not None and value < GREEDY_BELOW else value

    @model_validator(mode="before")
    @classmethod
    def _no_server_controls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            controls = SERVER_CONTROLS | (SERVER_CHAT_CONTROLS if "messages" in data else {})
            for field, neutral in controls.items():
                value = data.get(field)
                if value is not None and not any(_same(value, v) for v in neutral):
                    raise _refuse(
                        "unsupported",
                        "{field} is not supported: {field}={value}; expected {neutral}",
                        field=field,
                        value=json.dumps(value, default=str)[:80],
                        neutral=" or ".join(json.dumps(v) for v in (*neutral, None)),
                    )
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise _refuse(
                "stream_options",
                "stream_options is only allowed when stream is true",
                field="stream_options",
            )
        return self

    @field_validator(*SAMPLING_CONTROLS, mode="plain")
    @classmethod
    def _neutral_sampling(cls, value: Any, info) -> None:
        neutral = SAMPLING_CONTROLS[info.field_name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and value in neutral):
            raise _refuse(
                "unsupported",
                "{field} is not supported: {field}={value}; djax draws each sampled token "
                "at `temperature` within `top_k` and `top_p` alone; expected {neutral} or "
                "no {field}",
                field=info.field_name,
                value=json.dumps(value, default=str),  # as the client wrote it
                neutral=" or ".join(str(v) for v in neutral),
            )
        return None

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _no_logit_bias(cls, value: Any) -> None:
        if value not in (None, {}):
            raise _unsupported("logit_bias", "djax applies no bias to the logits")
        return None

    @field_validator("response_format", mode="plain")
    @classmethod
    def _text_only(cls, value: Any) -> None:
        if value is not None and value != {"type": "text"}:
            raise _unsupported(
                "response_format", 'djax answers in free text; expected {"type": "text"}'
            )
        return None

    @field_validator("best_of", mode="plain")
    @classmethod
    def _no_best_of(cls, value: Any) -> Any:
        if value not in (None, 1):
            raise _unsupported("best_of", "djax returns its one answer (best_of=1)")
        return value

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> Any:
        """OpenAI's rule: best_of candidates yield the n answers, so best_of >= n."""
        if self.best_of is not None and self.best_of < self.n:
            raise _refuse(
                "best_of",
                f"best_of={self.best_of} is less than n={self.n}; expected best_of >= n, or "
                "best_of left out",
                field="best_of",
            )
        return self

    @field_validator("echo", mode="plain")
    @classmethod
    def _no_echo(cls, value: Any) -> bool:
        if value not in (None, False):
            raise _unsupported("echo", "the answer never repeats the prompt")
        return False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk too (vLLM's `continuous_usage_stats`, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def answer_tokens(self) -> int | None:
        """The answer tokens asked for (None: the server's default)."""
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`: `prompt` is a string, a list of token ids, or a batch of up to
    `MAX_PROMPTS` of them (held as the batch: a single prompt is a batch of one), each
    answered `n` times."""

    prompt: tuple[str | list[int], ...]
    suffix: Any = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompts(cls, value: Any) -> tuple[str | list[int], ...]:
        if isinstance(value, str) or _is_ids(value):
            value = [value]  # one prompt
        if not isinstance(value, list):
            raise _refuse("prompt_type", PROMPT_TYPES)
        if len(value) > MAX_PROMPTS:
            raise _too_many("prompt_batch", len(value), "prompts", MAX_PROMPTS)
        for prompt in value or [[]]:
            if not isinstance(prompt, str) and not _is_ids(prompt):
                raise _refuse("prompt_type", PROMPT_TYPES)
            if not prompt:
                raise _refuse("prompt_empty", "is empty; expected at least one token")
        return tuple(value)

    @field_validator("suffix", mode="plain")
    @classmethod
    def _no_suffix(cls, value: Any) -> None:
        if value not in (None, ""):
            raise _unsupported("suffix", "djax completes after the prompt only")
        return None


def _same(value: Any, neutral: Any) -> bool:
    """`value` is `neutral`, of its JSON type (so 0 is not false, nor 1 true)."""
    return type(value) is type(neutral) and value == neutral


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


class ChatMessage(BaseModel):
    """One turn. `content` may be a list of text parts (joined); `developer` turns reach
    the chat template as `system` turns."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal[prompt_io.ROLES]
    content: str

    @field_validator("content", mode="plain")
    @classmethod
    def _text(cls, value: Any) -> str:
        text = prompt_io.turn_text(value)
        if text is None:
            raise _refuse(
                "content_type",
                'expected a string or a list of text parts ({"type": "text", "text": ...})',
            )
        return text

    def template_turn(self) -> dict[str, str]:
        return prompt_io.template_turn(self.role, self.content)


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`: the messages go through the model's chat template.
    `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("tools", "functions", mode="plain")
    @classmethod
    def _no_tools(cls, value: Any, info) -> None:
        if value not in (None, []):
            raise _unsupported(info.field_name, "djax does not call tools")
        return None

    @field_validator("tool_choice", "function_call", mode="plain")
    @classmethod
    def _no_tool_choice(cls, value: Any, info) -> None:
        if value not in (None, "none"):
            raise _unsupported(info.field_name, "djax does not call tools")
        return None

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: the token ids a prompt becomes, as the completions endpoint
    tokenises `prompt` (a string) or the chat endpoint `messages`; exactly one of them."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _refuse("tokenize_source", "expected exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: the text of token ids."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


def body_limit(max_sequence: int) -> int:
    """The largest request body a server of `max_sequence` tokens reads, in bytes: room for
    a batch of `MAX_PROMPTS` prompts of the whole sequence at `BODY_BYTES_PER_TOKEN` a token
    (as text or as ids), and at least 1 MiB. A larger body is refused unread (413): this
    bounds what one request makes the server parse and tokenise."""
    return max(2**20, MAX_PROMPTS * max_sequence * BODY_BYTES_PER_TOKEN)


def parse(kind: type[BaseModel], body: bytes) -> BaseModel:
    """The request `body` (JSON) validated as `kind`; raises ProtocolError (400) naming the
    first field at fault."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise ProtocolError(f"the body is not valid JSON: {first['msg']}") from None
        loc = ".".join(str(part) for part in first["loc"])
        # a check of the whole body names its field in the error's context
        param = loc or (first.get("ctx") or {}).get("field")
        where = f"{loc}: " if loc else "the body: "
        if loc and first["type"] in _PYDANTIC_ERRORS:  # the value, as the client wrote it
            where = f"{loc}={json.dumps(first['input'], default=str)[:80]}: "
        raise ProtocolError(where + first["msg"], param=param) from None


# --- responses --------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A whole answer, or (streamed) one chunk of it, its `usage` None but in the last and
    under continuous usage stats; OpenAI names both `text_completion`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """What a chat chunk adds; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _set_fields(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "djax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
