"""/v1/webhooks: an owner's webhook endpoints (create, list, retrieve, delete) and each one's
delivery log. The signing secret is returned once, by create. How events are signed and delivered:
api/webhooks.py."""

from __future__ import annotations

from fastapi import Depends, Header, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from api import services, webhooks
from api.auth import current_owner
from api.deps import Router, get_session
from api.errors import responses
from api.models import WebhookDelivery, WebhookEndpoint
from api.schemas import page
from kiln.types import ListOf, WebhookEndpointDeleted
from kiln.types import WebhookDelivery as DeliveryOut
from kiln.types import WebhookEndpoint as EndpointOut

router = Router(prefix="/v1/webhooks", tags=["webhooks"])
CREATE = "POST /v1/webhooks"
Limit = Query(20, ge=1, le=100, description="page size")
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
# http(s), a host name or a bracketed IPv6 address, a port, then printable ASCII (percent-encode the rest)
URL_PATTERN = rf"^https?://(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.?|\[[0-9A-Fa-f:.]+\])(?::{_PORT})?(?:[/?#][!-~]*)?$"


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2000, pattern=URL_PATTERN, description="where events are POSTed: http or https")
    events: list[webhooks.EventType] | None = Field(
        None, min_length=1, description="the event types to send; default: all four"
    )


@router.post("", response_model=EndpointOut, responses=responses(400, 409))
def create_webhook(
    req: WebhookCreate,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    idem: str | None = Header(None, alias="Idempotency-Key", max_length=300),
):
    """A new endpoint; the answer holds its signing secret (``whsec_…``), shown this once."""
    make = lambda: webhooks.endpoint_public(
        webhooks.create_endpoint(session, owner, req.url, req.events), with_secret=True
    )
    return services.idempotent(session, owner, idem, CREATE, req.model_dump_json(exclude_unset=True), make)


@router.get("", response_model=ListOf[EndpointOut], responses=responses(404))
def list_webhooks(
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = Query(None, max_length=64, description="the last endpoint id of the previous page"),
    limit: int = Limit,
):
    rows, more = services.paginate(session, webhooks.endpoints_of(owner), WebhookEndpoint, after, limit)
    return page([webhooks.endpoint_public(e) for e in rows], more)


@router.get("/{webhook_id}", response_model=EndpointOut, responses=responses(404))
def retrieve_webhook(webhook_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return webhooks.endpoint_public(webhooks.get_endpoint(session, owner, webhook_id))


@router.delete("/{webhook_id}", response_model=WebhookEndpointDeleted, responses=responses(404))
def delete_webhook(webhook_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    """The endpoint and its delivery log; events not yet delivered to it are dropped."""
    webhooks.delete_endpoint(session, owner, webhook_id)
    session.commit()
    return {"id": webhook_id, "object": "webhook_endpoint", "deleted": True}


@router.get("/{webhook_id}/deliveries", response_model=ListOf[DeliveryOut], responses=responses(404))
def list_deliveries(
    webhook_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = Query(None, max_length=64, description="the last delivery id of the previous page"),
    limit: int = Limit,
):
    """Newest first: each event, its attempts, the last status code or error, when it was delivered."""
    endpoint = webhooks.get_endpoint(session, owner, webhook_id)
    rows, more = services.paginate(session, webhooks.deliveries_of(endpoint), WebhookDelivery, after, limit)
    return page([webhooks.delivery_public(d) for d in rows], more)
