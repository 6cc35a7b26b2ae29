"""The inference server: its own process (``python -m workers.inference``), listening on
``KILN_INFERENCE_URL``'s host and port (default http://127.0.0.1:8766). It keeps one decoding
engine (``engine.inference.Batcher``) per base model, loaded on first use and kept, whose thread
decodes every running request of that model together; a fine-tune's adapter is added to its
base's engine on first use, by its store key. The API (api/routes/chat.py, api/inference.py) is
its one client: the handlers here only check, submit and stream.

Protocol (HTTP/1.1, JSON):

- ``GET /healthz``: ``{"ok": true, "open": 1, "models": {"kiln-tiny": ["jobs/ftjob-.../checkpoints/step-0000060"]}}``:
  the answers being streamed, the base models loaded and the adapters each holds.
- ``POST /v1/generate``, body ``kiln.chat.Generate`` (``base``, ``adapter``: a checkpoint's store
  key or null, ``messages``, ``max_tokens`` or null, ``max_tokens_param``, ``temperature``,
  ``top_p``, ``stop``, ``seed``, ``n``). Answer 200, ``application/x-ndjson``: one JSON object a
  line, sent as the tokens come:

  - ``{"index": 0, "text": "...", "finish_reason": null}``: choice 0's new text; its last line has
    ``finish_reason`` ``"stop"`` (the end of its turn, or a stop string, which is left out) or
    ``"length"`` (``max_tokens``);
  - ``{"usage": {"prompt_tokens": 12, "completion_tokens": 9}}``: the last line, once every choice
    has finished (completion tokens of all choices together);
  - ``{"error": {"message": "..."}}``: instead, when decoding failed; nothing follows.

  Or, before any line, an error in the API's shape, ``{"error": {"message", "param", "code"}}``:
  400 for a request the model cannot take (a prompt plus max_tokens over its position limit, an
  image it cannot read, an adapter that does not fit its base), 404 for a base model or an
  adapter the store does not hold, 500 for a failure (a model that does not load). Closing the
  connection cancels the request: its batch slots are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from api import logs
from api.deps import get_store
from api.observe import Observe
from api.settings import Settings, get_settings
from engine.inference import Batcher, Handle, Sampling
from engine.model.registry import ensure_builtin
from kiln.chat import DEFAULT_MAX_TOKENS, Generate
from kiln.dataset import parse_prompt
from kiln.spec import explain
from kiln.store import ObjectStore

log = logging.getLogger("kiln.inference")


@dataclass
class Refused(Exception):
    """A request the server cannot carry out, in the API's error shape."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def response(self) -> JSONResponse:
        error = {"message": self.message, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


class Models:
    """The base models' engines, each loaded once on first use (two first requests for one base
    load it once; a load holds up only that base's requests), and the adapters they hold."""

    def __init__(self, store: ObjectStore, settings: Settings):
        self.store, self.settings = store, settings
        self.batchers: dict[str, Batcher] = {}
        self.folders: dict[str, Path] = {}  # each adapter's local folder, once fetched from the store
        self.open = 0  # answers being streamed (changed on the event loop only)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def batcher(self, base: str) -> Batcher:
        with self._lock(base):
            if base not in self.batchers:
                folder = self.store.model_dir(base)
                ensure_builtin(base, folder)  # the built-in models, written once, as the training worker does
                if not (folder / "config.json").exists():
                    raise Refused(404, f"no base model {base!r} in the store", "model", "model_not_found")
                log.info("loading %s from %s", base, folder)
                device, batch = self.settings.inference_device or None, self.settings.inference_max_batch
                b = Batcher(folder, device=device, max_batch=batch, max_adapters=self.settings.inference_max_adapters)
                b.start()
                self.batchers[base] = b
            return self.batchers[base]

    def adapter(self, base: str, key: str) -> Path:
        """The adapter's folder, the adapter checked against its base and loaded once (the base
        may unload it for others: a request then loads it again from this folder)."""
        b = self.batchers[base]
        with self._lock(f"{base} {key}"):
            if key in self.folders:
                return self.folders[key]
            folder = self.store.path(key)
            if not (folder / "adapter_config.json").exists():
                raise Refused(404, f"no adapter at {key!r} in the store", "model", "adapter_not_found")
            try:
                b.add_adapter(key, folder)
            except ValueError as e:
                raise Refused(400, f"model: the adapter does not fit its base model: {e}", "model") from e
            self.folders[key] = folder
            return folder

    def submit(self, req: Generate) -> Handle:
        """Check the request against its model and hand it to the model's engine."""
        b = self.batcher(req.base)
        folder = self.adapter(req.base, req.adapter) if req.adapter is not None else None
        example, issues = parse_prompt([m.model_dump(exclude_none=True) for m in req.messages])
        if example is None:
            raise Refused(400, "; ".join(f"{i.field}: {i.message}" for i in issues[:5]), issues[0].field)
        try:
            ids, pixels = b.encode(example)
        except (ValueError, OSError) as e:  # OSError: an image Pillow cannot read
            raise Refused(400, str(e) if str(e).startswith("messages") else f"messages: {e}", "messages") from e
        param, limit = req.max_tokens_param, b.context_limit
        room = None if limit is None else limit - len(ids)
        if room is not None and room < 1:
            raise Refused(
                400,
                f"messages: the prompt is {len(ids)} tokens; {req.base} takes at most {limit} tokens, prompt and "
                "answer together",
                "messages",
                "context_length_exceeded",
            )
        if req.max_tokens is not None and room is not None and req.max_tokens > room:
            raise Refused(
                400,
                f"{param}: the prompt is {len(ids)} tokens and {param} {req.max_tokens}, over {req.base}'s position "
                f"limit of {limit} tokens (prompt and answer together); ask for at most {room}",
                param,
                "context_length_exceeded",
            )
        max_tokens = req.max_tokens or min(DEFAULT_MAX_TOKENS, room or DEFAULT_MAX_TOKENS)
        sampling = Sampling(max_tokens, req.temperature, req.top_p, tuple(req.stop), req.seed, req.n)
        try:
            return b.submit(ids, pixels, req.adapter, sampling, folder)
        except ValueError as e:
            raise Refused(400, str(e)) from e

    def close(self) -> None:
        for b in self.batchers.values():
            b.close()


def _pump(h: Handle, loop: asyncio.AbstractEventLoop, out: asyncio.Queue) -> None:
    """A request's thread: the engine's chunks (a blocking iterator) into the event loop, then a
    None (or the engine's error). Its own thread, not the loop's pool: it waits as long as the
    answer takes, and however many requests are open."""
    put = lambda item: loop.call_soon_threadsafe(out.put_nowait, item)
    try:
        for chunk in h:
            put(chunk)
        put(None)
    except Exception as e:  # a failed forward: the request's answer says so
        log.exception("decoding failed")
        put(e)


async def _lines(h: Handle, models: Models) -> AsyncIterator[str]:
    """The NDJSON answer; a client gone (the generator closed early) cancels the request."""
    out: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=_pump, args=(h, asyncio.get_running_loop(), out), daemon=True).start()
    done = False
    models.open += 1
    try:
        while (item := await out.get()) is not None:
            if isinstance(item, Exception):
                done = True
                yield json.dumps({"error": {"message": f"decoding failed: {type(item).__name__}: {item}"}}) + "\n"
                return
            yield json.dumps({"index": item.index, "text": item.text, "finish_reason": item.finish_reason}) + "\n"
        done = True
        usage = {"prompt_tokens": h.prompt_tokens, "completion_tokens": h.completion_tokens}
        yield json.dumps({"usage": usage}) + "\n"
    finally:
        models.open -= 1
        if not done:
            h.cancel()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    models = Models(get_store(), settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        models.close()

    app = FastAPI(title="Kiln inference server", lifespan=lifespan, openapi_url=None)
    app.add_middleware(Observe)  # the API's request id (x-request-id) on this server's lines too

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        text, param = explain(list(exc.errors()), Generate)
        return Refused(400, text, param, "invalid_request").response()

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        held = {base: sorted(b.adapters.names) for base, b in models.batchers.items()}
        return {"ok": True, "open": models.open, "models": held}

    @app.post("/v1/generate")
    async def generate(req: Generate):
        try:
            h = await asyncio.to_thread(models.submit, req)  # a first use loads the model: off the loop
        except Refused as e:
            return e.response()
        except Exception as e:  # a model that does not load, say: the API passes the reason on
            log.exception("request failed")
            return Refused(
                500, f"the inference server failed: {type(e).__name__}: {e}", None, "inference_error"
            ).response()
        return StreamingResponse(_lines(h, models), media_type="application/x-ndjson")

    return app


def main() -> None:
    settings = get_settings()
    logs.configure(settings.log_format)
    url = urlsplit(settings.inference_url)
    if url.hostname is None or url.port is None:
        raise SystemExit(f"KILN_INFERENCE_URL must name a host and a port: {settings.inference_url!r}")
    uvicorn.run(
        create_app(settings),
        host=url.hostname,
        port=url.port,
        log_level="warning",
        log_config=None,
        timeout_keep_alive=75,
    )


if __name__ == "__main__":
    main()
