"""/v1/chat/completions: OpenAI's chat completions, answered by the inference server
(workers/inference.py, its own process) with a base model or one of the caller's fine-tunes."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import inference, services
from api.auth import current_owner
from api.deps import Router, get_session
from api.errors import responses
from api.settings import get_settings
from kiln.chat import ChatRequest, generate_body
from kiln.types import ChatCompletion

router = Router(prefix="/v1/chat", tags=["chat"])
STREAM: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "the answer (chat.completion), or with stream true Server-Sent Events of "
        "chat.completion.chunk objects ending with data: [DONE]",
    }
}


@router.post("/completions", response_model=ChatCompletion, responses={**STREAM, **responses(400, 404, 409, 503)})
async def create_chat_completion(
    req: ChatRequest,
    request: Request,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
):
    """400: a request the model cannot take (the message names the field); 404: another owner's
    or an unknown fine-tuned model; 409: a fine-tune whose job has not succeeded; 503: the
    inference server is not reachable."""
    try:
        target = await run_in_threadpool(services.chat_model, session, owner, req.model)
    finally:
        session.close()  # no connection held while the answer is generated
    settings = get_settings()
    services.check_chat(req, target.card, settings.max_image_pixels)
    up = await inference.open_generation(generate_body(req, target.card.name, target.adapter), settings)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            inference.events(up, req.model, req.n, usage),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )
    return await inference.unless_gone(request.receive, inference.collect(up, req.model, req.n))
