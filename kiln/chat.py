"""The chat contract, torch-free: the body of ``POST /v1/chat/completions`` (OpenAI's fields,
unknown fields refused) and the body the API sends the inference server (``Generate``). The
answers are ``kiln.types``' ``ChatCompletion`` and, streamed, ``ChatCompletionChunk``.

Bounds: ``n`` 1..8 (``MAX_N``: one request's choices decode side by side in one batch), ``stop``
up to 4 strings, ``temperature`` 0..2 (0: greedy), ``top_p`` over 0 up to 1, ``max_tokens``
(or its newer name ``max_completion_tokens``; both given must agree) 1..32768; with none given
an answer ends at ``DEFAULT_MAX_TOKENS`` or the model's position limit, whichever comes first. A
prompt plus ``max_tokens`` over the model's position limit is a 400 from the inference server,
which alone can count the prompt's tokens.

Accepted and ignored, as OpenAI documents them: ``user`` (an end-user id), and at their defaults
only ``logprobs`` (false), ``frequency_penalty`` and ``presence_penalty`` (0), ``response_format``
(``{"type": "text"}``); any other value of these is a 400 saying it is not supported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Interval
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Strict, Tag

from kiln.catalog import CARDS
from kiln.spec import SpecError, Whole

MAX_N = 8
MAX_STOP = 4
MAX_TOKENS = 32768
DEFAULT_MAX_TOKENS = 4096  # with no max_tokens: where an answer stops at the latest (or the position limit)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageUrl(_Request):
    url: str = Field(description="a data: URL (data:image/png;base64,...); remote URLs are not fetched")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored")


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def _by_kind(what: str) -> Discriminator:
    """A string or a list, the other branch's errors left out (the tags are the ones
    ``kiln.spec.field_path`` drops from an error's path)."""
    return Discriminator(
        lambda v: "str" if isinstance(v, str) else "list" if isinstance(v, list) else None,
        custom_error_type="invalid_type",
        custom_error_message=f"must be a string or a list of {what}",
    )


class ChatMessage(_Request):
    """One turn: a string, or OpenAI's content parts (text and inline images), as a dataset's
    messages take them (``kiln.dataset.parse_prompt``)."""

    role: Literal["system", "user", "assistant"]
    content: Annotated[
        Annotated[str, Tag("str")] | Annotated[list[Part], Tag("list")], _by_kind("content parts (text, image_url)")
    ]


class StreamOptions(_Request):
    include_usage: Annotated[bool, Field(strict=True)] = Field(
        False, description="one more chunk before [DONE], with the usage and no choices"
    )


Tokens = Annotated[int, Strict(), Interval(ge=1, le=MAX_TOKENS), Whole]
LimitName = Literal["max_tokens", "max_completion_tokens"]
Stop = Annotated[str, Field(min_length=1, max_length=256)]


def _off(message: str):
    def check(v: Any) -> Any:
        if v:
            raise ValueError(message)
        return v

    return AfterValidator(check)


def _text_format(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None and v != {"type": "text"}:
        raise ValueError('not supported: answers are plain text; leave it out or send {"type": "text"}')
    return v


class ChatRequest(_Request):
    """``POST /v1/chat/completions``. ``model``: a base model or one of your fine-tunes (``ft:...``,
    a checkpoint's ``ft:...:ckpt-step-N`` or ``ftckpt_...``)."""

    model: str = Field(
        min_length=1,
        max_length=300,
        json_schema_extra={"anyOf": [{"enum": list(CARDS)}, {"pattern": "^(ft:|ftckpt_)"}]},
        description="a base model, or one of your fine-tuned models or checkpoints",
    )
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, ending with a user turn")
    max_tokens: Tokens | None = Field(None, description="the most tokens each choice generates")
    max_completion_tokens: Tokens | None = Field(None, description="max_tokens' newer name; give one")
    temperature: Annotated[float, Strict(), Field(ge=0, le=2)] = Field(1.0, description="0: greedy")
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = Field(1.0, description="nucleus sampling's mass")
    stop: (
        Annotated[
            Annotated[Stop, Tag("str")] | Annotated[list[Stop], Field(max_length=MAX_STOP), Tag("list")],
            _by_kind("strings"),
        ]
        | None
    ) = Field(None, description=f"up to {MAX_STOP} strings; an answer ends before the first, which it leaves out")
    seed: Annotated[int, Strict(), Interval(ge=-(2**63), le=2**63 - 1), Whole] | None = Field(
        None, description="the same seed and request give the same answer"
    )
    n: Annotated[int, Strict(), Interval(ge=1, le=MAX_N), Whole] = Field(1, description=f"choices, 1 to {MAX_N}")
    stream: Annotated[bool, Field(strict=True)] = Field(False, description="Server-Sent Events of completion chunks")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="accepted and ignored")
    logprobs: Annotated[bool | None, _off("not supported: no log probabilities yet; leave it out or false")] = None
    frequency_penalty: Annotated[float | None, _off("not supported; leave it out or 0")] = None
    presence_penalty: Annotated[float | None, _off("not supported; leave it out or 0")] = None
    response_format: Annotated[dict[str, Any] | None, AfterValidator(_text_format)] = None

    def completion_limit(self) -> tuple[int | None, LimitName]:
        """(the most tokens a choice takes, None: the default; the field it came from). Both
        names with different values are a ``SpecError`` naming both."""
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise SpecError(
                f"max_tokens ({a}) and max_completion_tokens ({b}) differ; give one of them", "max_completion_tokens"
            )
        return (b, "max_completion_tokens") if a is None and b is not None else (a, "max_tokens")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise SpecError("stream_options: only with stream true", "stream_options")


class Generate(_Request):
    """What the API asks the inference server (``POST /v1/generate``, workers/inference.py): the
    base model by name, the adapter by its store key (a checkpoint folder in the PEFT layout; also
    its name in the server), the checked messages and the sampling settings."""

    base: str
    adapter: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, or what the position limit leaves
    max_tokens_param: LimitName = "max_tokens"  # the name the request used, for errors
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None
    n: int = 1


def generate_body(req: ChatRequest, base: str, adapter: str | None) -> Generate:
    """The inference server's request for a checked chat request."""
    limit, param = req.completion_limit()
    return Generate(
        base=base,
        adapter=adapter,
        messages=req.messages,
        max_tokens=limit,
        max_tokens_param=param,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stops(),
        seed=req.seed,
        n=req.n,
    )
