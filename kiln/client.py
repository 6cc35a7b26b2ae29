"""The Kiln Python SDK: one client object, resources as attributes.

    from kiln import Client
    client = Client("http://127.0.0.1:8000", api_key="sk-kiln-...")
    f = client.files.upload("train.jsonl", progress=True)
    job = client.jobs.create("kiln-tiny", f.id, hyperparameters={"n_epochs": 3})
    job = client.jobs.wait(job.id, progress=True)
    client.adapters.download(job.id, "adapter.zip")
    client.exports.download(job.fine_tuned_model, "merged.zip")   # the adapter merged into the base
    hi = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(job.fine_tuned_model, hi)
    for chunk in client.chat.completions.stream(job.fine_tuned_model, hi):
        print("".join(c.delta.content or "" for c in chunk.choices), end="")

Connection errors, 408, 429 and 5xx answers are retried with exponential backoff (a POST keeps
one Idempotency-Key across its retries, so it is never applied twice); other errors raise the
exception class of their status, carrying the server's message.
"""

from __future__ import annotations

import builtins
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from kiln.errors import APIConnectionError, KilnError, from_response
from kiln.exports import Export
from kiln.spec import Hyperparameters, JobRequest, LoraSpec, explain
from kiln.types import ApiKeyInfo, ChatCompletion, ChatCompletionChunk, Checkpoint, FileObject, Job, JobEvent, Model


class _Listed(Protocol):
    id: str


T = TypeVar("T", bound=_Listed)
DEFAULT_URL = "http://127.0.0.1:8000"
RETRY_STATUS = (408, 429)


class Page(Generic[T]):
    """One page of a list; iterating walks every later page too."""

    def __init__(self, client: Client, path: str, cls: type[T], params: dict[str, Any]):
        self._client, self._path, self._cls, self._params = client, path, cls, params
        body = client._json("GET", path, params={k: v for k, v in params.items() if v is not None})
        self.data: list[T] = [cls(**d) for d in body["data"]]
        self.has_more: bool = body.get("has_more", False)

    def __iter__(self) -> Iterator[T]:
        page: Page[T] | None = self
        while page is not None:
            yield from page.data
            page = (
                Page(self._client, self._path, self._cls, {**self._params, "after": page.data[-1].id})
                if page.has_more and page.data
                else None
            )


class Client:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        http_client: httpx.Client | None = None,
    ):
        self.base_url = (base_url or os.environ.get("KILN_BASE_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key or os.environ.get("KILN_API_KEY")
        if not self.api_key:
            raise ValueError("api_key is required (or set KILN_API_KEY)")
        self.max_retries, self.backoff = max_retries, backoff
        self._http = http_client or httpx.Client(timeout=timeout)
        self.files, self.jobs, self.adapters = Files(self), Jobs(self), Adapters(self)
        self.models, self.keys, self.exports = Models(self), Keys(self), Exports(self)
        self.chat = Chat(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sleep(self, attempt: int, response: httpx.Response | None) -> None:
        after = response.headers.get("retry-after") if response is not None else None
        delay = float(after) if after and after.replace(".", "", 1).isdigit() else self.backoff * 2**attempt
        time.sleep(min(delay, 30.0) * (0.75 + random.random() / 2))

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        content: Callable[[], Any] | None = None,
        headers: dict | None = None,
        stream: bool = False,
        timeout: float | None | object = ...,
    ) -> httpx.Response:
        """Send with retries. ``content`` is a factory: a streamed body is rebuilt for each try."""
        hdrs = {"Authorization": f"Bearer {self.api_key}", **(headers or {})}
        if method == "POST":
            hdrs.setdefault("Idempotency-Key", f"kiln-{uuid.uuid4()}")
        extra: dict[str, Any] = {} if timeout is ... else {"timeout": timeout}
        for attempt in range(self.max_retries + 1):
            req = self._http.build_request(
                method,
                self.base_url + path,
                json=json,
                params=params,
                content=content() if content else None,
                headers=hdrs,
                **extra,
            )
            try:
                resp = self._http.send(req, stream=stream)
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"could not reach {self.base_url}: {e}") from e
                self._sleep(attempt, None)
                continue
            if resp.status_code < 400:
                return resp
            retry = (resp.status_code in RETRY_STATUS or resp.status_code >= 500) and resp.headers.get(
                "x-should-retry"
            ) != "false"
            if retry and attempt < self.max_retries:
                resp.close()
                self._sleep(attempt, resp)
                continue
            resp.read()
            try:
                body = resp.json()
            except ValueError:
                body = {"error": {"message": resp.text[:500] or resp.reason_phrase}}
            raise from_response(resp.status_code, body, resp.headers.get("x-request-id"))
        raise AssertionError("unreachable")

    @contextmanager
    def stream(self, method: str, path: str, **kw) -> Iterator[httpx.Response]:
        """A response whose body is read as it arrives; closed on exit."""
        resp = self.request(method, path, stream=True, **kw)
        try:
            yield resp
        finally:
            resp.close()

    def _json(self, method: str, path: str, **kw) -> Any:
        return self.request(method, path, **kw).json()


class Files:
    def __init__(self, client: Client):
        self._c = client

    def upload(
        self, path: str | Path, purpose: str = "fine-tune", progress: bool | Callable[[int, int], None] = False
    ) -> FileObject:
        """Stream a file up. ``progress``: True for a bar on stderr, or a callback(sent, total)."""
        path = Path(path)
        total = path.stat().st_size
        boundary = uuid.uuid4().hex
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        report = _bar(f"upload {path.name}", total) if progress is True else (progress or None)

        def body() -> Iterator[bytes]:
            yield head
            sent = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    sent += len(chunk)
                    yield chunk
                    if report:
                        report(sent, total)
            yield tail

        headers = {
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Content-Length": str(len(head) + total + len(tail)),
        }
        return FileObject(**self._c._json("POST", "/v1/files", content=body, headers=headers))

    def list(self, purpose: str | None = None, limit: int = 100) -> Page[FileObject]:
        return Page(self._c, "/v1/files", FileObject, {"purpose": purpose, "limit": limit})

    def get(self, file_id: str) -> FileObject:
        return FileObject(**self._c._json("GET", f"/v1/files/{file_id}"))

    def delete(self, file_id: str) -> bool:
        return self._c._json("DELETE", f"/v1/files/{file_id}")["deleted"]

    def content(self, file_id: str) -> bytes:
        return self._c.request("GET", f"/v1/files/{file_id}/content").content


class Jobs:
    def __init__(self, client: Client):
        self._c = client

    def create(
        self,
        model: str | JobRequest,
        training_file: str | None = None,
        *,
        validation_file: str | None = None,
        images_file: str | None = None,
        hyperparameters: Hyperparameters | dict[str, Any] | None = None,
        lora: LoraSpec | dict[str, Any] | None = None,
        suffix: str | None = None,
        seed: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Job:
        """Start a fine-tune. Takes the job contract (``kiln.spec``) typed: a whole
        ``JobRequest``, or its fields with ``Hyperparameters`` / ``LoraSpec`` (or plain dicts of
        theirs). The request is checked here first, as the server checks it: a typo'd field or a
        value out of bounds raises ``ValueError`` naming it before anything is sent."""
        if isinstance(model, JobRequest):
            request = model
        else:
            fields = {
                "model": model,
                "training_file": training_file,
                "validation_file": validation_file,
                "images_file": images_file,
                "hyperparameters": hyperparameters,
                "lora": lora,
                "suffix": suffix,
                "seed": seed,
                "metadata": metadata,
            }
            as_dicts = {
                k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v
                for k, v in fields.items()
                if v is not None
            }
            try:
                request = JobRequest.model_validate(as_dicts)
            except ValidationError as e:
                raise ValueError(explain(e, JobRequest)[0]) from None
        body = request.model_dump(mode="json", exclude_unset=True)
        return Job(**self._c._json("POST", "/v1/fine_tuning/jobs", json=body))

    def pause(self, job_id: str) -> Job:
        """A queued job pauses at once; a running one saves a checkpoint at its next step."""
        return Job(**self._c._json("POST", f"/v1/fine_tuning/jobs/{job_id}/pause"))

    def resume(self, job_id: str) -> Job:
        """Back in line; it continues from the checkpoint it paused at."""
        return Job(**self._c._json("POST", f"/v1/fine_tuning/jobs/{job_id}/resume"))

    def list(self, limit: int = 20) -> Page[Job]:
        return Page(self._c, "/v1/fine_tuning/jobs", Job, {"limit": limit})

    def get(self, job_id: str) -> Job:
        return Job(**self._c._json("GET", f"/v1/fine_tuning/jobs/{job_id}"))

    def cancel(self, job_id: str) -> Job:
        return Job(**self._c._json("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel"))

    def events(self, job_id: str, limit: int = 100) -> builtins.list[JobEvent]:  # builtins: Jobs.list shadows list here
        """Every event, oldest first."""
        events = list(Page(self._c, f"/v1/fine_tuning/jobs/{job_id}/events", JobEvent, {"limit": limit}))
        return events[::-1]

    def checkpoints(self, job_id: str) -> builtins.list[Checkpoint]:
        return list(Page(self._c, f"/v1/fine_tuning/jobs/{job_id}/checkpoints", Checkpoint, {"limit": 100}))

    def stream(self, job_id: str, after: int = 0) -> Iterator[JobEvent]:
        """Live events (Server-Sent Events) until the job ends; reconnects where it left off."""
        cursor, failures = after, 0
        while True:
            try:
                with self._c.stream(
                    "GET",
                    f"/v1/fine_tuning/jobs/{job_id}/events/stream",
                    headers={"Last-Event-ID": str(cursor)},
                    timeout=None,
                ) as resp:
                    kind, ident = None, None
                    for line in resp.iter_lines():
                        if line.startswith("event: "):
                            kind = line[7:]
                        elif line.startswith("id: "):
                            ident = int(line[4:])
                        elif line.startswith("data: "):
                            if kind == "end":
                                return
                            if kind in ("message", "metrics"):
                                yield JobEvent(**json.loads(line[6:]))
                                cursor, failures = ident or cursor, 0
                        elif not line:
                            kind, ident = None, None
            except (httpx.TransportError, APIConnectionError) as e:
                failures += 1
                if failures > self._c.max_retries:
                    raise APIConnectionError(f"lost the event stream of {job_id}") from e
                self._c._sleep(failures - 1, None)

    def wait(self, job_id: str, *, progress: bool = False, on_event: Callable[[JobEvent], None] | None = None) -> Job:
        """Follow the job until it ends; returns the finished job."""
        bar = _bar("train", 0) if progress else None
        for ev in self.stream(job_id):
            if on_event:
                on_event(ev)
            if bar and ev.type == "metrics" and ev.data:
                bar(ev.data["step"], ev.data.get("total_steps", 0), f"loss {ev.data['train_loss']:.4f}")
        if bar:
            sys.stderr.write("\n")
        return self.get(job_id)


class Adapters:
    def __init__(self, client: Client):
        self._c = client

    def download(self, job_id: str, path: str | Path | None = None, *, checkpoint: str | None = None) -> Path:
        """Save the adapter zip (the final one, or a checkpoint's). Written to a temp name first,
        so an interrupted download never looks complete."""
        url = f"/v1/fine_tuning/jobs/{job_id}" + (f"/checkpoints/{checkpoint}/adapter" if checkpoint else "/adapter")
        dest = Path(path or f"{job_id}{'-' + checkpoint if checkpoint else ''}.zip")
        tmp = dest.with_name(dest.name + ".part")
        with self._c.stream("GET", url) as resp, open(tmp, "wb") as f:
            for chunk in resp.iter_bytes(1 << 20):
                f.write(chunk)
        tmp.replace(dest)
        return dest


class Models:
    def __init__(self, client: Client):
        self._c = client

    def list(self) -> list[Model]:
        return [Model(**m) for m in self._c._json("GET", "/v1/models")["data"]]


class Chat:
    """``client.chat.completions``, as the openai SDK names it."""

    def __init__(self, client: Client):
        self.completions = Completions(client)


class Completions:
    def __init__(self, client: Client):
        self._c = client

    def create(self, model: str, messages: builtins.list[dict], **params: Any) -> ChatCompletion:
        """An answer from a base model or a fine-tuned one (``ft:...``, or a checkpoint's name):
        ``messages`` as in a training file (text, or parts with ``image_url`` data: URLs), and
        OpenAI's parameters (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
        ``n``). For the answer as it is decided, ``stream``."""
        if params.get("stream"):
            raise ValueError("stream=True: use client.chat.completions.stream(...)")
        body = {"model": model, "messages": messages, **params}
        return ChatCompletion(**self._c._json("POST", "/v1/chat/completions", json=body, timeout=None))

    def stream(self, model: str, messages: builtins.list[dict], **params: Any) -> Iterator[ChatCompletionChunk]:
        """The answer in pieces (Server-Sent Events): per choice a chunk with the role, chunks of
        text, a chunk with its finish_reason; with ``stream_options={"include_usage": True}`` a
        last chunk holds the usage. Closing the iterator early stops the decoding."""
        body = {"model": model, "messages": messages, **params, "stream": True}
        with self._c.stream("POST", "/v1/chat/completions", json=body, timeout=None) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    if line == "data: [DONE]":
                        return
                    data = json.loads(line[6:])
                    if "error" in data:  # the decoding failed after the answer began
                        raise KilnError(data["error"].get("message", "the stream failed"))
                    yield ChatCompletionChunk(**data)


class Exports:
    """A fine-tuned model's merged export: its base with the adapter folded into the weights, in
    the family's layout (safetensors), made on a worker and downloaded as a zip."""

    def __init__(self, client: Client):
        self._c = client

    @staticmethod
    def _path(model: str) -> str:
        return f"/v1/models/{quote(model, safe=':@')}/export"

    def create(self, model: str) -> Export:
        """Start the export (a worker merges), or get the one already made or under way."""
        return Export(**self._c._json("POST", self._path(model)))

    def get(self, model: str) -> Export:
        return Export(**self._c._json("GET", self._path(model)))

    def wait(self, model: str, *, interval: float = 2.0, timeout: float | None = None) -> Export:
        """Start the export if it is not under way, then poll every ``interval`` seconds until
        it has succeeded or failed (``TimeoutError`` after ``timeout`` seconds)."""
        export = self.create(model)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not export.done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the export of {model} is still {export.status} after {timeout} s")
            time.sleep(interval)
            export = self.get(model)
        return export

    def download(self, model: str, path: str | Path | None = None, *, timeout: float | None = None) -> Path:
        """Wait for the export (started if need be) and save its zip; a failed export raises
        ``KilnError`` with its error. Written to a temp name first, so an interrupted download
        never looks complete."""
        export = self.wait(model, timeout=timeout)
        if export.status != "succeeded":
            reason = export.error.message if export.error else "no reason given"
            raise KilnError(f"the export of {model} failed: {reason}")
        dest = Path(path or "".join(c if c.isalnum() or c in "-_." else "_" for c in model) + "-merged.zip")
        tmp = dest.with_name(dest.name + ".part")
        with self._c.stream("GET", self._path(model) + "/content") as resp, open(tmp, "wb") as f:
            for chunk in resp.iter_bytes(1 << 20):
                f.write(chunk)
        tmp.replace(dest)
        return dest


class Keys:
    def __init__(self, client: Client):
        self._c = client

    def list(self) -> list[ApiKeyInfo]:
        return [ApiKeyInfo(**k) for k in self._c._json("GET", "/v1/keys")["data"]]

    def create(self, name: str = "") -> ApiKeyInfo:
        return ApiKeyInfo(**self._c._json("POST", "/v1/keys", json={"name": name}))

    def revoke(self, key_id: str) -> ApiKeyInfo:
        return ApiKeyInfo(**self._c._json("DELETE", f"/v1/keys/{key_id}"))


def _bar(label: str, total: int) -> Callable[..., None]:
    """A one-line progress bar on stderr: report(done, total, note='')."""

    def report(done: int, total_now: int = total, note: str = "") -> None:
        width = 30
        frac = done / total_now if total_now else 0.0
        fill = int(width * frac)
        sys.stderr.write(f"\r{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total_now or '?'} {note}  ")
        sys.stderr.flush()

    return report
