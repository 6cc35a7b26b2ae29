"""Streaming multipart/form-data: the file part goes straight to the store's temp area in
constant memory, and the size limit stops the upload the moment it is passed."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from kiln.store import ObjectStore, TooLarge, Upload

MAX_FIELD_BYTES = 64 << 10


@dataclass
class Received:
    fields: dict[str, str] = field(default_factory=dict)
    upload: Upload | None = None
    filename: str = ""


async def receive(request: Request, store: ObjectStore, limit: int, file_field: str = "file") -> Received:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(
            415, "Send the file as multipart/form-data with fields 'file' and 'purpose'", code="unsupported_media_type"
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MAX_FIELD_BYTES:
        raise ApiError(
            413, f"File is larger than the upload limit of {limit} bytes", param="file", code="file_too_large"
        )

    out = Received()
    state: dict = {"headers": {}, "name": None, "buf": bytearray(), "hname": b"", "hval": b""}

    def on_header_field(data, start, end):
        state["hname"] += data[start:end]

    def on_header_value(data, start, end):
        state["hval"] += data[start:end]

    def on_header_end():
        state["headers"][state["hname"].decode("latin-1").lower()] = state["hval"]
        state["hname"], state["hval"] = b"", b""

    def on_headers_finished():
        _, opts = parse_options_header(state["headers"].get("content-disposition", b""))
        state["name"] = opts.get(b"name", b"").decode()
        if state["name"] == file_field and b"filename" in opts:
            if out.upload is not None:
                raise ApiError(400, "Send one file per upload", param="file")
            out.filename = opts[b"filename"].decode("utf-8", "replace").replace("\\", "/").rsplit("/", 1)[-1]
            out.upload = store.upload(limit)
            state["file"] = True
        else:
            state["file"] = False

    def on_part_data(data, start, end):
        if state["file"]:
            out.upload.write(data[start:end])
        else:
            state["buf"] += data[start:end]
            if len(state["buf"]) > MAX_FIELD_BYTES:
                raise ApiError(400, f"Form field {state['name']!r} is too long", param=state["name"])

    def on_part_end():
        if not state["file"] and state["name"]:
            out.fields[state["name"]] = state["buf"].decode("utf-8", "replace")
        state["buf"], state["headers"] = bytearray(), {}

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
        if out.upload is not None:
            await run_in_threadpool(out.upload.finish)
    except TooLarge as e:
        if out.upload:
            out.upload.abort()
        raise ApiError(
            413, f"File is larger than the upload limit of {e.limit} bytes", param="file", code="file_too_large"
        ) from e
    except ApiError:
        if out.upload:
            out.upload.abort()
        raise
    except Exception as e:  # client went away, malformed body, disk full: keep nothing
        if out.upload:
            out.upload.abort()
        if isinstance(e, OSError):
            raise ApiError(507, f"Could not store the upload: {e.strerror or e}", code="storage_error") from e
        raise ApiError(400, f"Malformed multipart body: {e}", code="malformed_body") from e
    if out.upload is None:
        raise ApiError(400, "Missing the 'file' part of the form", param="file", code="missing_file")
    return out
