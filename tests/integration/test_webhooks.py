"""Webhooks against the real stack (PostgreSQL, Redis, the API, a training worker and the webhook
worker), received by a real HTTP server on 127.0.0.1 that checks every Standard Webhooks signature
with its own code: a succeeded job's event, retries with one webhook-id, owner isolation, a delivery
that does not wait behind training, and one that survives its sender's kill -9."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from api.webhooks import EVENT_TYPES, sign
from tests.conftest import finished, wait_for
from tests.stack import Stack, free_port

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
# The Standard Webhooks reference vector (the same in Svix's and standard-webhooks' libraries' tests)
VECTOR = {
    "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
    "timestamp": "1614265330",
    "body": b'{"test": 2432232314}',
    "signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
}


@dataclass(frozen=True)
class Hit:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    at: float


def signed_by(hit: Hit, secret: str) -> bool:
    """The receiver's check, written from the spec: HMAC-SHA256 keyed with the base64 after
    ``whsec_``, over ``id.timestamp.body``, against each ``v1,`` entry of the header."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    content = f"{hit.headers['webhook-id']}.{hit.headers['webhook-timestamp']}.".encode() + hit.body
    expected = base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()
    entries = [entry.partition(",") for entry in hit.headers["webhook-signature"].split(" ")]
    return any(v == "v1" and hmac.compare_digest(sig, expected) for v, _, sig in entries)


class Receiver:
    """Keeps every request and answers by path: ``/flaky…`` 500 to its first request then 200,
    ``/gone…`` 410, ``/hold…`` holds its first request open until ``release`` is set, else 200."""

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        self.held, self.release = threading.Event(), threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver.answer(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length", 0)))
        hit = Hit(h.path, {k.lower(): v for k, v in h.headers.items()}, body, time.time())
        with self.lock:
            first = not self.got(h.path)
            self.hits.append(hit)
        code = 200
        if h.path.startswith("/flaky") and first:
            code = 500
        elif h.path.startswith("/gone"):
            code = 410
        elif h.path.startswith("/hold") and first:
            self.held.set()
            self.release.wait(120)
        try:
            h.send_response(code)
            h.send_header("content-length", "0")
            h.end_headers()
        except OSError:  # the sender is gone (killed while we held its request)
            pass

    def got(self, path: str) -> list[Hit]:
        return [hit for hit in self.hits if hit.path == path]

    def wait(self, path: str, n: int, timeout: float = 60) -> list[Hit]:
        return wait_for(lambda: len(self.got(path)) >= n and self.got(path), timeout=timeout, what=f"{n} at {path}")


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack(
        webhook_timeout_seconds=5,  # a sender holds a delivery 2x this: the kill test waits that out
        webhook_backoff_seconds=1,
        webhook_resend_after_seconds=1,
        webhook_max_attempts=3,
    )


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.release.set()
    r.server.shutdown()


def owner(stack: Stack, name: str) -> httpx.Client:
    """A client of a new owner: the endpoints and jobs of each test apart from the others'."""
    stack.keys[name] = stack.admin("create-key", "--owner", name, "--name", "test")
    return stack.client(name)


def hook(c: httpx.Client, url: str, **body) -> dict:
    r = c.post("/v1/webhooks", json={"url": url, **body})
    assert r.status_code == 200, r.text
    return r.json()


def job(c: httpx.Client, **hyperparameters) -> str:
    f = c.post("/v1/files", files={"file": ("t.jsonl", (json.dumps(GOOD) + "\n") * 4)}, data={"purpose": "fine-tune"})
    r = c.post(
        "/v1/fine_tuning/jobs",
        json={"model": "kiln-tiny", "training_file": f.json()["id"], "hyperparameters": hyperparameters},
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def cancelled_job(c: httpx.Client) -> str:
    """A job cancelled at once (queued) or at its next step (running): either way, one event."""
    job_id = job(c, n_epochs=1000, batch_size=1)
    assert c.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    return job_id


def log(c: httpx.Client, hook_id: str) -> list[dict]:
    r = c.get(f"/v1/webhooks/{hook_id}/deliveries")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def settled(c: httpx.Client, hook_id: str, status: str, timeout: float = 60) -> dict:
    """The endpoint's one delivery, once it is ``status``."""
    return wait_for(lambda: (d := log(c, hook_id)) and d[0]["status"] == status and d[0], timeout=timeout, what=status)


def test_signatures_follow_the_published_vector():
    ours = sign(VECTOR["secret"], VECTOR["id"], int(VECTOR["timestamp"]), VECTOR["body"])
    assert ours == VECTOR["signature"]
    headers = {"webhook-id": VECTOR["id"], "webhook-timestamp": VECTOR["timestamp"]}
    hit = Hit("/", {**headers, "webhook-signature": "v1,bm9wZQ== " + ours}, VECTOR["body"], 0)  # one must match
    assert signed_by(hit, VECTOR["secret"])  # the receiver's check below agrees with the vector
    assert not signed_by(replace(hit, body=hit.body + b" "), VECTOR["secret"])
    assert not signed_by(replace(hit, headers={**hit.headers, "webhook-timestamp": "1614265331"}), VECTOR["secret"])


def test_a_succeeded_job_sends_one_signed_event(stack, receiver):
    with owner(stack, "hooks-signed") as c:
        every = hook(c, receiver.url("/all"))
        failures = hook(c, receiver.url("/failures"), events=["fine_tuning.job.failed"])
        assert every["secret"].startswith("whsec_") and len(base64.b64decode(every["secret"][6:])) == 32
        assert every["events"] == list(EVENT_TYPES) and failures["events"] == ["fine_tuning.job.failed"]
        listed = c.get("/v1/webhooks").json()["data"]
        assert [h["id"] for h in listed] == [failures["id"], every["id"]]  # newest first
        assert all(h["secret"] is None for h in listed)  # shown once, when made
        assert c.get(f"/v1/webhooks/{every['id']}").json() == {**every, "secret": None}

        job_id = job(c, max_steps=2)
        assert finished(c, job_id)["status"] == "succeeded"
        [hit] = receiver.wait("/all", 1)
        assert signed_by(hit, every["secret"]) and not signed_by(hit, failures["secret"])
        assert abs(time.time() - int(hit.headers["webhook-timestamp"])) < 120
        assert hit.headers["content-type"] == "application/json"
        event = json.loads(hit.body)
        assert event["id"].startswith("evt_") and isinstance(event["created_at"], int)
        assert event == {**event, "object": "event", "type": "fine_tuning.job.succeeded", "data": {"id": job_id}}

        d = settled(c, every["id"], "delivered")
        assert d["id"] == hit.headers["webhook-id"] and d["event_id"] == event["id"] and d["job_id"] == job_id
        assert (d["attempts"], d["last_status_code"], d["last_error"]) == (1, 200, None) and d["delivered_at"]
        assert log(c, failures["id"]) == [] and receiver.got("/failures") == []


def test_a_failed_attempt_is_retried_with_the_same_webhook_id(stack, receiver):
    with owner(stack, "hooks-retry") as c:
        flaky = hook(c, receiver.url("/flaky"))
        gone = hook(c, receiver.url("/gone"))
        nobody = hook(c, f"http://127.0.0.1:{free_port()}/nobody-listens")
        job_id = cancelled_job(c)
        first, second = receiver.wait("/flaky", 2)
        assert first.headers["webhook-id"] == second.headers["webhook-id"] and first.body == second.body
        assert signed_by(first, flaky["secret"]) and signed_by(second, flaky["secret"])
        assert second.at - first.at >= 0.8  # the backoff: 1 s, +-10%
        assert json.loads(first.body)["type"] == "fine_tuning.job.cancelled"
        assert json.loads(first.body)["data"] == {"id": job_id}
        d = settled(c, flaky["id"], "delivered")
        assert (d["attempts"], d["last_status_code"], d["last_error"]) == (2, 200, None)

        d = settled(c, gone["id"], "failed")  # 410 Gone: no more attempts
        assert (d["attempts"], d["last_status_code"], d["last_error"]) == (1, 410, "HTTP 410")
        assert len(receiver.got("/gone")) == 1 and d["next_attempt_at"] is None

        d = settled(c, nobody["id"], "failed")  # refused three times (webhook_max_attempts), then given up
        assert d["attempts"] == 3 and d["last_status_code"] is None and "ConnectError" in d["last_error"]


def test_another_owner_sees_no_endpoint_and_gets_no_event(stack, receiver):
    with owner(stack, "hooks-alice") as alice, owner(stack, "hooks-bob") as bob:
        mine = hook(alice, receiver.url("/alice"))
        theirs = hook(bob, receiver.url("/bob"))
        for r in (
            bob.get(f"/v1/webhooks/{mine['id']}"),
            bob.get(f"/v1/webhooks/{mine['id']}/deliveries"),
            bob.delete(f"/v1/webhooks/{mine['id']}"),
        ):
            assert r.status_code == 404 and r.json()["error"]["code"] == "webhook_endpoint_not_found"
        assert [h["id"] for h in bob.get("/v1/webhooks").json()["data"]] == [theirs["id"]]
        assert alice.get(f"/v1/webhooks/{mine['id']}").status_code == 200  # bob's delete did nothing

        job_id = cancelled_job(bob)
        [hit] = receiver.wait("/bob", 1)
        assert json.loads(hit.body)["data"] == {"id": job_id} and signed_by(hit, theirs["secret"])
        assert log(alice, mine["id"]) == [] and receiver.got("/alice") == []  # written with bob's, or never

        r = alice.delete(f"/v1/webhooks/{mine['id']}")
        assert r.status_code == 200 and r.json() == {"id": mine["id"], "object": "webhook_endpoint", "deleted": True}
        assert alice.get(f"/v1/webhooks/{mine['id']}").status_code == 404
        assert alice.get(f"/v1/webhooks/{mine['id']}/deliveries").status_code == 404
        for bad in (
            {"url": "ftp://example.com/hook"},
            {"url": "127.0.0.1/hook"},
            {"url": receiver.url("/x"), "events": ["fine_tuning.job.started"]},
            {"url": receiver.url("/x"), "events": []},
            {"url": receiver.url("/x"), "secret": "whsec_mine"},
        ):
            r = alice.post("/v1/webhooks", json=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad


def test_a_delivery_does_not_wait_behind_training(stack, receiver):
    """The one training worker is busy with a long job; another job's events still arrive."""
    with owner(stack, "hooks-busy") as c:
        long_job = job(c, n_epochs=1000, batch_size=1)
        wait_for(lambda: c.get(f"/v1/fine_tuning/jobs/{long_job}").json()["status"] == "running", what="training")
        hook(c, receiver.url("/busy"), events=["fine_tuning.job.paused", "fine_tuning.job.cancelled"])
        waiting = job(c, max_steps=2)  # queued behind the long one: paused, then cancelled, at once
        assert c.post(f"/v1/fine_tuning/jobs/{waiting}/pause").json()["status"] == "paused"
        assert c.post(f"/v1/fine_tuning/jobs/{waiting}/cancel").json()["status"] == "cancelled"
        hits = receiver.wait("/busy", 2, timeout=30)
        events = sorted((e["type"], e["data"]["id"]) for e in (json.loads(h.body) for h in hits))
        assert events == [("fine_tuning.job.cancelled", waiting), ("fine_tuning.job.paused", waiting)]
        assert c.get(f"/v1/fine_tuning/jobs/{long_job}").json()["status"] == "running"
        c.post(f"/v1/fine_tuning/jobs/{long_job}/cancel")
        assert finished(c, long_job)["status"] == "cancelled"
        assert json.loads(receiver.wait("/busy", 3)[2].body)["data"] == {"id": long_job}


def test_an_event_survives_its_sender_dying_mid_delivery(stack, receiver):
    with owner(stack, "hooks-kill") as c:
        held = hook(c, receiver.url("/hold"))
        cancelled_job(c)
        assert receiver.held.wait(60), "the delivery never came"
        assert stack.webhook_worker is not None
        stack.kill_worker(stack.webhook_worker)  # kill -9 while its request is open
        receiver.release.set()
        d = log(c, held["id"])[0]
        assert d["status"] == "pending" and d["attempts"] == 1 and d["last_status_code"] is None
        stack.start_webhook_worker()
        first, again = receiver.wait("/hold", 2)
        assert first.headers["webhook-id"] == again.headers["webhook-id"] == d["id"]
        assert signed_by(again, held["secret"]) and again.body == first.body
        d = settled(c, held["id"], "delivered")
        assert d["attempts"] == 2 and d["last_status_code"] == 200
