"""The API's side of chat: the inference server's client (workers/inference.py; its protocol is in
that module's docstring: NDJSON over HTTP) and the translation of its lines into OpenAI's
``chat.completion`` object or its stream of ``chat.completion.chunk`` Server-Sent Events.

Torch-free, like all of api/: the server does the tokenizing and decoding.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import httpx

from api import logs
from api.errors import ApiError
from api.settings import Settings
from kiln.chat import Generate

log = logging.getLogger("kiln.api")
T = TypeVar("T")


def unreachable(settings: Settings, why: str) -> ApiError:
    return ApiError(
        503,
        f"The inference server at {settings.inference_url} is not reachable ({why}); it runs as "
        "`python -m workers.inference` beside the API (KILN_INFERENCE_URL names it)",
        code="inference_unavailable",
    )


class Upstream:
    """One answer of the inference server, open: its lines, parsed, as they come. Reading them to
    the end, or ``close``, lets the connection go; closing it early cancels the generation."""

    def __init__(self, client: httpx.AsyncClient, response: httpx.Response, settings: Settings):
        self.client, self.response, self.settings = client, response, settings

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in self.response.aiter_lines():
                if line.strip():
                    yield json.loads(line)
        except httpx.TransportError as e:  # the server went away mid-answer
            log.warning("the inference server's answer broke off: %r", e)
            yield {"error": {"message": f"the inference server's answer broke off ({type(e).__name__})"}}
        finally:
            await self.close()

    async def close(self) -> None:
        await self.response.aclose()
        await self.client.aclose()


def _request_id() -> dict[str, str]:
    """The API's request id goes along: the inference server's log lines carry it too."""
    rid = logs.current().get("request_id")
    return {"x-request-id": rid} if rid else {}


async def open_generation(body: Generate, settings: Settings) -> Upstream:
    """Send the request; return once the server has accepted it (its first byte), or raise its
    error in the API's shape (its 400 for a prompt the model cannot take, passed through), or a
    503 when it cannot be reached."""
    client = httpx.AsyncClient(
        base_url=settings.inference_url, timeout=httpx.Timeout(settings.inference_timeout_seconds, connect=5.0)
    )
    try:
        response = await client.send(
            client.build_request(
                "POST",
                "/v1/generate",
                content=body.model_dump_json(),
                headers={"content-type": "application/json", **_request_id()},
            ),
            stream=True,
        )
    except httpx.TransportError as e:
        await client.aclose()
        raise unreachable(settings, type(e).__name__) from e
    except BaseException:
        await client.aclose()
        raise
    if response.status_code == 200:
        return Upstream(client, response, settings)
    try:
        raw = await response.aread()
    finally:
        await response.aclose()
        await client.aclose()
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": f"the inference server answered {response.status_code}: {raw[:200]!r}"}
    raise ApiError(response.status_code, error.get("message", ""), param=error.get("param"), code=error.get("code"))


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def _usage(u: dict[str, int]) -> dict[str, int]:
    return {**u, "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


async def collect(up: Upstream, model: str, n: int) -> dict[str, Any]:
    """The whole answer as OpenAI's ``chat.completion``."""
    texts, reasons = [""] * n, [None] * n
    usage = None
    async for line in up.lines():
        if "error" in line:
            raise ApiError(500, f"The inference server failed: {line['error']['message']}", code="inference_error")
        if "usage" in line:
            usage = line["usage"]
            continue
        texts[line["index"]] += line["text"]
        reasons[line["index"]] = line["finish_reason"] or reasons[line["index"]]
    if usage is None or None in reasons:
        raise ApiError(500, "The inference server's answer ended before every choice finished", code="inference_error")
    return {
        "id": completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r, "logprobs": None}
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ],
        "usage": _usage(usage),
        "system_fingerprint": None,
    }


async def events(up: Upstream, model: str, n: int, include_usage: bool) -> AsyncIterator[str]:
    """The answer as Server-Sent Events: per choice a first chunk with ``delta.role``, then its
    text as it comes, then a chunk with its ``finish_reason``; with ``include_usage`` a last chunk
    with no choices and the usage (and ``usage: null`` on the others); then ``data: [DONE]``. A
    failure mid-stream is an ``error`` event (the openai SDK raises it), and the stream ends."""
    head = {"id": completion_id(), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    head["system_fingerprint"] = None
    if include_usage:
        head["usage"] = None

    def chunk(index: int, delta: dict[str, str], finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for line in up.lines():
            if "error" in line:
                error = {"message": line["error"]["message"], "type": "server_error", "code": "inference_error"}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            if "usage" in line:
                if include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(line['usage'])})}\n\n"
                continue
            if line["text"]:
                yield chunk(line["index"], {"content": line["text"]})
            if line["finish_reason"]:
                yield chunk(line["index"], {}, line["finish_reason"])
        yield "data: [DONE]\n\n"
    finally:
        await up.close()


async def unless_gone(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], work: Awaitable[T]) -> T:
    """``work``'s result; or, when the client hangs up first, ``work`` cancelled (and with it the
    generation) and a 499 nobody reads. ``receive`` is the request's, its body already read: it
    answers ``http.disconnect`` when the client goes."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its upstream closed before we go on
    if task.cancelled():
        raise ApiError(499, "the client closed the connection", code="client_closed")
    return task.result()
