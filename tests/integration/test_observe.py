"""What an operator sees: request ids (header, error bodies, log lines), JSON log lines with the
owner and the job but never the key, the API's and a worker's Prometheus metrics scraped while a
job runs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kiln
from tests.conftest import finished
from tests.stack import free_port

STEPS = 6


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=5).raise_for_status().text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def log_lines(stack, name: str) -> list[dict]:
    return [json.loads(line) for line in stack.log(name).splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack(worker_metrics_port=free_port())


@pytest.fixture(scope="module")
def job_run(stack, sample):
    """One kiln-tiny job, the worker's /metrics scraped every 0.1 s while it runs."""
    worker_url = f"http://127.0.0.1:{stack.env['KILN_WORKER_METRICS_PORT']}/metrics"
    seen: list[dict] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                seen.append(scrape(worker_url))
            except httpx.HTTPError:
                pass  # the worker is still starting
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with stack.client() as c:
        lines = (sample / "train.jsonl").read_text().splitlines()
        data = "\n".join(line for line in lines if '"images"' not in line).encode()  # kiln-tiny reads text
        f = c.post("/v1/files", files={"file": ("t.jsonl", data)}, data={"purpose": "fine-tune"}).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", "training_file": f["id"], "hyperparameters": {"max_steps": STEPS}},
            headers={"x-request-id": "my-trace.42"},
        )
        job = finished(c, job.json()["id"])
    done.set()
    poller.join()
    return {"job": job, "during": seen, "after": scrape(worker_url)}


def test_request_id_in_header_error_body_and_log(stack):
    with stack.client() as c:
        ok = c.get("/v1/files")
        given = c.get("/v1/fine_tuning/jobs/ftjob-nope", headers={"x-request-id": "client-chosen-1"})
        bad_id = c.get("/v1/files", headers={"x-request-id": "no spaces allowed"})
    assert ok.headers["x-request-id"].startswith("req_") and len(ok.headers["x-request-id"]) == 28
    assert given.status_code == 404
    assert given.headers["x-request-id"] == "client-chosen-1" == given.json()["error"]["request_id"]
    assert bad_id.headers["x-request-id"].startswith("req_")  # an id that is not sane is replaced
    unauth = httpx.get(f"{stack.base_url}/v1/files")
    assert unauth.status_code == 401 and unauth.json()["error"]["request_id"] == unauth.headers["x-request-id"]

    lines = log_lines(stack, "api")
    access = {line["request_id"]: line for line in lines if line["logger"] == "kiln.access"}
    line = access["client-chosen-1"]
    assert line["status"] == 404 and line["route"] == "/v1/fine_tuning/jobs/{job_id}"
    assert line["owner_id"] == "alice" and line["key_id"].startswith("key_") and line["job_id"] == "ftjob-nope"
    assert {"ts", "level", "msg", "duration_ms"} <= set(line)
    assert access[ok.headers["x-request-id"]]["status"] == 200
    for secret in stack.keys.values():  # the key itself is never written
        assert secret not in stack.log("api")

    with kiln.Client(stack.base_url, stack.keys["alice"]) as sdk, pytest.raises(kiln.NotFoundError) as e:
        sdk.jobs.get("ftjob-nope")
    assert e.value.request_id and e.value.request_id.startswith("req_") and e.value.request_id in str(e.value)


def test_api_metrics(stack, job_run):
    m = scrape(f"{stack.base_url}/metrics")
    route = (("method", "POST"), ("route", "/v1/fine_tuning/jobs"), ("status", "200"))
    assert m[("kiln_http_requests_total", route)] == 1
    lat = (("method", "GET"), ("route", "/v1/fine_tuning/jobs/{job_id}"))
    assert m[("kiln_http_request_duration_seconds_count", lat)] >= 1
    assert m[("kiln_jobs", (("status", "succeeded"),))] == 1
    assert m[("kiln_queue_depth", ())] == 0 and m[("kiln_database_up", ())] == 1
    # one label set per route template, not per job id
    assert not any("ftjob-" in str(k) for k in m)


def test_worker_metrics_during_and_after_a_job(stack, job_run):
    assert job_run["job"]["status"] == "succeeded"
    running = [s for s in job_run["during"] if s.get(("kiln_worker_jobs_running", ())) == 1]
    assert running, "no scrape saw the job running"
    assert any(s.get(("kiln_worker_steps_total", ()), 0) > 0 for s in running), "no scrape saw a step while it ran"
    after = job_run["after"]
    assert after[("kiln_worker_jobs_running", ())] == 0
    assert after[("kiln_worker_steps_total", ())] == STEPS
    assert after[("kiln_worker_step_seconds_count", ())] == STEPS
    assert after[("kiln_worker_tokens_per_second", ())] > 0
    assert after[("kiln_worker_jobs_total", (("outcome", "succeeded"),))] == 1

    lines = log_lines(stack, "worker0")
    mine = [line["msg"] for line in lines if line.get("job_id") == job_run["job"]["id"]]
    assert any("started" in m for m in mine) and any("succeeded" in m for m in mine), mine
    api = [line for line in log_lines(stack, "api") if line.get("request_id") == "my-trace.42"]
    assert api and api[0]["route"] == "/v1/fine_tuning/jobs" and api[0]["owner_id"] == "alice"
