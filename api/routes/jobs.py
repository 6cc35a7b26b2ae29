"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, events, checkpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Query
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import services
from api.auth import current_owner
from api.deps import get_session, get_store
from api.models import Job
from api.schemas import JobCreate, checkpoint_public, event_public, job_public, page
from api.settings import get_settings
from kiln.store import LocalStore

router = APIRouter(prefix="/v1/fine_tuning/jobs")


@router.post("")
def create_job(
    req: JobCreate,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: LocalStore = Depends(get_store),
    idem: str | None = Header(None, alias="Idempotency-Key"),
):
    prior = services.replay(session, owner, idem, "POST /v1/fine_tuning/jobs")
    if prior:
        return prior
    job = services.create_job(session, store, get_settings(), owner, req)
    body = job_public(job)
    services.remember(session, owner, idem, "POST /v1/fine_tuning/jobs", 200, body)
    session.commit()
    services.start_job(session, job)
    return body


@router.get("")
def list_jobs(
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = None,
    limit: int = Query(20),
):
    rows, more = services.paginate(session, select(Job).where(Job.owner == owner), Job, after, limit)
    return page([job_public(j) for j in rows], more)


@router.get("/{job_id}")
def retrieve_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return job_public(services.get_job(session, owner, job_id))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return job_public(services.cancel_job(session, owner, job_id))


@router.get("/{job_id}/events")
def list_events(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = None,
    limit: int = Query(20),
):
    job = services.get_job(session, owner, job_id)
    rows, more = services.list_events(session, job, after, limit)
    return page([event_public(e) for e in rows], more)


@router.get("/{job_id}/checkpoints")
def list_checkpoints(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = None,
    limit: int = Query(10),
):
    job = services.get_job(session, owner, job_id)
    rows, more = services.list_checkpoints(session, job, after, limit)
    return page([checkpoint_public(c, job) for c in rows], more)
