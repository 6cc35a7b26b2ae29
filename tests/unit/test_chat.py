"""The chat contract without a server: a request's messages as a prompt (kiln.dataset.parse_prompt),
the request body's checks (kiln.chat), and the inference server's NDJSON lines turned into
OpenAI's objects (api.inference), read back with the official openai SDK's own types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletion as SdkCompletion
from openai.types.chat import ChatCompletionChunk as SdkChunk
from pydantic import ValidationError

from api.errors import ApiError
from api.inference import Upstream, collect, events
from kiln.chat import ChatRequest, Generate, generate_body
from kiln.dataset import parse_line, parse_prompt
from kiln.spec import SpecError, explain

PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR42mP4z8AAAAMBAQD3A0FDAAAAAElFTkSuQmCC"
)


def issues(messages: Any) -> list[str]:
    example, found = parse_prompt(messages)
    assert (example is None) == bool(found)
    return [f"{i.field}: {i.message}" for i in found]


def test_a_prompt_takes_the_datasets_forms():
    parts = [{"type": "image_url", "image_url": {"url": PNG}}, {"type": "text", "text": "How many?"}]
    example, found = parse_prompt(
        [
            {"role": "system", "content": "Count."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": ""},  # an empty answer is context in a prompt
            {"role": "user", "content": parts},
        ]
    )
    assert found == [] and example is not None
    assert [(m.role, m.content) for m in example.messages] == [
        ("system", "Count."),
        ("user", "hi"),
        ("assistant", ""),
        ("user", "<image>How many?"),
    ]
    assert example.images == [PNG]
    # a dataset line still refuses an empty assistant turn: it would be a training target
    _, line_issues = parse_line(
        1, json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]})
    )
    assert [str(i) for i in line_issues] == ["line 1: messages[1].content: empty assistant turn"]


def test_a_prompt_names_each_problems_field():
    assert issues([]) == ["messages: must be a non-empty list of messages"]
    assert issues([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == [
        "messages[1].role: the last message is the assistant's; end with a user (or system) message: the answer "
        "follows it"
    ]
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.test/a.png"}}]}]
    assert issues(remote) == [
        "messages[0].content[0].image_url.url: must be a data: URL (data:image/png;base64,...); image URLs and "
        "paths are not fetched"
    ]
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]
    assert issues(broken) == ["messages[0].content[0].image_url.url: data URL holds invalid base64"]
    assert issues([{"role": "user", "content": "<image> and no image"}]) == [
        "messages: 1 <image> placeholder(s) but 0 image(s): an <image> in a text stands for an image_url part's "
        "image; send images as image_url parts only"
    ]


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "kiln-tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(**kw: Any) -> str:
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate(body(**kw))
    return explain(e.value, ChatRequest)[0]


def test_the_request_states_its_bounds_and_names_the_field():
    assert refused(n=9) == "n: Input should be less than or equal to 8"
    assert refused(n=0) == "n: Input should be greater than or equal to 1"
    assert refused(max_tokens=0) == "max_tokens: Input should be greater than or equal to 1"
    assert refused(temperature="1") == "temperature: Input should be a valid number"
    assert refused(stop=3) == "stop: must be a string or a list of strings"
    assert refused(stop=["a", ""]) == "stop[1]: String should have at least 1 character"
    assert refused(messages=[{"role": "user", "content": 5}]) == (
        "messages[0].content: must be a string or a list of content parts (text, image_url)"
    )
    assert refused(messages=[{"role": "user", "content": [{"type": "audio"}]}]).startswith(
        "messages[0].content[0]: Input tag 'audio' found using 'type' does not match any of the expected tags"
    )
    assert refused(messages=[{"role": "user", "content": "hi", "name": "x"}]) == "messages[0].name: unknown field"
    assert refused(top_k=5) == "top_k: unknown field; did you mean 'top_p'?"
    assert refused(frequency_penalty=0.5) == "frequency_penalty: not supported; leave it out or 0"
    assert refused(response_format={"type": "json_object"}).startswith("response_format: not supported")
    ok = ChatRequest.model_validate(
        body(user="u1", logprobs=False, presence_penalty=0, response_format={"type": "text"})
    )
    assert ok.user == "u1"  # documented fields OpenAI's clients send, accepted and ignored


def test_max_tokens_has_two_names_that_must_agree():
    assert ChatRequest.model_validate(body()).completion_limit() == (None, "max_tokens")
    assert ChatRequest.model_validate(body(max_completion_tokens=7)).completion_limit() == (7, "max_completion_tokens")
    assert ChatRequest.model_validate(body(max_tokens=7, max_completion_tokens=7)).completion_limit() == (
        7,
        "max_tokens",
    )
    with pytest.raises(SpecError) as e:
        ChatRequest.model_validate(body(max_tokens=7, max_completion_tokens=8)).completion_limit()
    assert str(e.value) == "max_tokens (7) and max_completion_tokens (8) differ; give one of them"


def test_the_inference_servers_request_round_trips():
    req = ChatRequest.model_validate(body(stop="\n", seed=-5, n=3, max_completion_tokens=9, temperature=0))
    sent = generate_body(req, "kiln-tiny", "jobs/ftjob-x/checkpoints/step-0000004")
    back = Generate.model_validate_json(sent.model_dump_json())
    assert back == sent and back.stop == ["\n"] and back.max_tokens_param == "max_completion_tokens"
    assert [m.model_dump(exclude_none=True) for m in back.messages] == [{"role": "user", "content": "hi"}]


class Lines(Upstream):
    """An answer the inference server sent, replayed."""

    def __init__(self, lines: list[dict[str, Any]]):
        self._lines, self.closed = lines, False

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        for line in self._lines:
            yield line

    async def close(self) -> None:
        self.closed = True


ANSWER = [
    {"index": 1, "text": "4", "finish_reason": None},
    {"index": 0, "text": "1", "finish_reason": None},
    {"index": 0, "text": "8", "finish_reason": "stop"},
    {"index": 1, "text": "", "finish_reason": "length"},
    {"usage": {"prompt_tokens": 10, "completion_tokens": 5}},
]


def test_the_answer_is_a_chat_completion():
    answer = asyncio.run(collect(Lines(ANSWER), "ft:kiln-tiny:alice::x", 2))
    sdk = SdkCompletion.model_validate(answer)
    assert sdk.id.startswith("chatcmpl-") and sdk.model == "ft:kiln-tiny:alice::x"
    assert [(c.index, c.message.content, c.finish_reason) for c in sdk.choices] == [
        (0, "18", "stop"),
        (1, "4", "length"),
    ]
    assert sdk.usage is not None and (sdk.usage.prompt_tokens, sdk.usage.completion_tokens, sdk.usage.total_tokens) == (
        10,
        5,
        15,
    )
    with pytest.raises(ApiError, match="decoding failed: boom"):
        asyncio.run(collect(Lines([ANSWER[0], {"error": {"message": "decoding failed: boom"}}]), "kiln-tiny", 2))
    with pytest.raises(ApiError, match="ended before every choice finished"):
        asyncio.run(collect(Lines(ANSWER[:2]), "kiln-tiny", 2))


async def frames(up: Upstream, n: int, usage: bool) -> list[str]:
    return [f async for f in events(up, "kiln-tiny", n, usage)]


def test_the_stream_is_openais_chunks_then_done():
    up = Lines(ANSWER)
    sent = asyncio.run(frames(up, 2, usage=True))
    assert up.closed and all(f.startswith("data: ") and f.endswith("\n\n") for f in sent)
    assert sent[-1] == "data: [DONE]\n\n"
    chunks = [SdkChunk.model_validate(json.loads(f[6:])) for f in sent[:-1]]
    assert len({c.id for c in chunks}) == 1
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[2:-1]:
        [choice] = c.choices
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert text == {0: "18", 1: "4"} and finish == {0: "stop", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 15
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk, and no usage key at all
    plain = asyncio.run(frames(Lines(ANSWER), 2, usage=False))
    assert len(plain) == len(sent) - 1 and all("usage" not in json.loads(f[6:]) for f in plain[:-1])


def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises():
    sent = asyncio.run(frames(Lines([ANSWER[1], {"error": {"message": "decoding failed: boom"}}]), 1, usage=False))
    assert sent[-1] != "data: [DONE]\n\n"
    assert json.loads(sent[-1][6:]) == {
        "error": {"message": "decoding failed: boom", "type": "server_error", "code": "inference_error"}
    }
