"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, pause, resume, events, checkpoints."""

from __future__ import annotations

from fastapi import Depends, Header, Query
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from api import services
from api.auth import current_owner
from api.deps import Router, get_session, get_store
from api.errors import responses
from api.models import Job
from api.schemas import checkpoint_public, event_public, job_public, page
from api.settings import get_settings
from kiln.spec import JobRequest
from kiln.store import ObjectStore
from kiln.types import Checkpoint, JobEvent, ListOf
from kiln.types import Job as JobOut

router = Router(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
CREATE = "POST /v1/fine_tuning/jobs"
Limit = Query(20, ge=1, le=100, description="page size")


@router.post("", response_model=JobOut, responses=responses(400, 404, 409))
def create_job(
    req: JobRequest,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    store: ObjectStore = Depends(get_store),
    idem: str | None = Header(None, alias="Idempotency-Key", max_length=300),
):
    made: list[Job] = []

    def make() -> dict:
        made.append(services.create_job(session, store, get_settings(), owner, req))
        return job_public(made[0])

    answer = services.idempotent(session, owner, idem, CREATE, req.model_dump_json(exclude_unset=True), make)
    if made and not isinstance(answer, JSONResponse):  # made now, not a replay
        services.start_job(session, made[0])
    return answer


@router.get("", response_model=ListOf[JobOut], responses=responses(404))
def list_jobs(
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = Query(None, max_length=64, description="the last job id of the previous page"),
    limit: int = Limit,
):
    rows, more = services.paginate(session, select(Job).where(Job.owner == owner), Job, after, limit)
    return page([job_public(j) for j in rows], more)


@router.get("/{job_id}", response_model=JobOut, responses=responses(404))
def retrieve_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return job_public(services.get_job(session, owner, job_id))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=responses(404, 409))
def cancel_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    return job_public(services.cancel_job(session, owner, job_id))


@router.post("/{job_id}/pause", response_model=JobOut, responses=responses(404, 409))
def pause_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    """A queued job is paused at once; a running one saves a checkpoint at its next step and lets
    its worker go (``pausing``, then ``paused``)."""
    return job_public(services.pause_job(session, owner, job_id))


@router.post("/{job_id}/resume", response_model=JobOut, responses=responses(404, 409))
def resume_job(job_id: str, owner: str = Depends(current_owner), session: Session = Depends(get_session)):
    """A paused job goes back in line and continues from its last checkpoint, exactly."""
    return job_public(services.resume_job(session, owner, job_id))


@router.get("/{job_id}/events", response_model=ListOf[JobEvent], responses=responses(404))
def list_events(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = Query(None, max_length=64, description="the last event id of the previous page"),
    limit: int = Limit,
):
    job = services.get_job(session, owner, job_id)
    rows, more = services.list_events(session, job, after, limit)
    return page([event_public(e) for e in rows], more)


@router.get("/{job_id}/checkpoints", response_model=ListOf[Checkpoint], responses=responses(404))
def list_checkpoints(
    job_id: str,
    owner: str = Depends(current_owner),
    session: Session = Depends(get_session),
    after: str | None = Query(None, max_length=64, description="the last checkpoint id of the previous page"),
    limit: int = Query(10, ge=1, le=100, description="page size"),
):
    job = services.get_job(session, owner, job_id)
    rows, more = services.list_checkpoints(session, job, after, limit)
    return page([checkpoint_public(c, job) for c in rows], more)
