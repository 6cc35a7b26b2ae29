"""Owner isolation on every route, archive and image bombs, oversized lines, per-key rate limits
(one budget across API processes)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import zipfile

import httpx
import pytest
from PIL import Image

import kiln
from tests.conftest import wait_for
from tests.stack import free_port

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack(
        max_archive_unpacked_bytes=10_000_000, max_archive_members=50, max_line_bytes=4000, max_image_pixels=1_000_000
    )


def upload(c, name, content):
    return c.post("/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"})


@pytest.fixture(scope="module")
def alices(stack):
    """One of each of alice's objects: a file, a finished job with a checkpoint, a key."""
    with stack.client() as c:
        f = upload(c, "a.jsonl", (json.dumps(GOOD) + "\n").encode() * 4).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                "training_file": f["id"],
                "suffix": "mine",
                "hyperparameters": {"max_steps": 2, "batch_size": 2},
            },
        ).json()
        job = wait_for(
            lambda: (j := c.get(f"/v1/fine_tuning/jobs/{job['id']}").json())["status"] == "succeeded" and j,
            what="alice's job",
        )
        ckpt = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][0]
        key = c.post("/v1/keys", json={"name": "second"}).json()
        hook = c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"}).json()
        spec = c.get("/openapi.json").json()
    return {
        "file_id": f["id"],
        "job_id": job["id"],
        "ckpt_id": ckpt["id"],
        "key_id": key["id"],
        "webhook_id": hook["id"],
        "model_id": job["fine_tuned_model"],
        "spec": spec,
    }


def test_every_route_hides_other_owners_objects(stack, alices):
    params = {k: v for k, v in alices.items() if k != "spec"}
    paths = alices["spec"]["paths"]
    checked = 0
    with stack.client("bob") as bob:
        for path, methods in paths.items():
            names = re.findall(r"{(\w+)(?::\w+)?}", path)
            url = re.sub(r"{(\w+)(?::\w+)?}", lambda m: params[m.group(1)], path)
            for method in methods:
                if method == "post" and not names:
                    continue  # creating is covered below
                r = bob.request(method.upper(), url, json={} if method == "post" else None)
                if names:
                    assert r.status_code == 404, (method, path, r.status_code, r.text)
                else:
                    assert r.status_code == 200, (method, path)
                    body = r.text
                    assert not any(v in body for v in params.values()), (method, path)
                checked += 1
        r = bob.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": alices["file_id"]})
        assert r.status_code == 404 and "No file found" in r.json()["error"]["message"]
    assert checked >= 15  # every route of the spec was tried
    with stack.client() as alice:  # and nothing of alice's changed
        assert alice.get(f"/v1/files/{alices['file_id']}").status_code == 200
        assert alice.get(f"/v1/fine_tuning/jobs/{alices['job_id']}").json()["status"] == "succeeded"
        assert not [k for k in alice.get("/v1/keys").json()["data"] if k["id"] == alices["key_id"] and k["revoked_at"]]


def test_zip_bomb_and_member_count_are_refused(stack):
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("train.jsonl", b"\n" * 30_000_000)  # 30 MB of newlines packs to ~30 KB
    assert len(bomb.getvalue()) < 200_000
    many = io.BytesIO()
    with zipfile.ZipFile(many, "w") as zf:
        for i in range(60):
            zf.writestr(f"images/{i}.png", b"x")
    with stack.client() as c:
        r = upload(c, "bomb.zip", bomb.getvalue())
        assert (
            r.status_code == 400
            and "unpacks to 30000000 bytes, over the limit of 10000000" in r.json()["error"]["message"]
        )
        r = upload(c, "many.zip", many.getvalue())
        assert r.status_code == 400 and "60 members, over the limit of 50" in r.json()["error"]["message"]


def test_image_decompression_bomb_is_refused(stack):
    buf = io.BytesIO()
    Image.new("1", (2000, 2000)).save(buf, format="PNG")  # 4 Mpixel, a few KB on disk
    ds = io.BytesIO()
    with zipfile.ZipFile(ds, "w") as zf:
        zf.writestr(
            "train.jsonl",
            json.dumps(
                {
                    "images": ["big.png"],
                    "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}],
                }
            )
            + "\n",
        )
        zf.writestr("big.png", buf.getvalue())
    with stack.client() as c:
        r = upload(c, "big.zip", ds.getvalue())
    assert r.status_code == 400
    assert (
        "line 1: images[0]: image is 2000x2000 pixels, over the limit of 1000000 pixels" in r.json()["error"]["message"]
    )


def test_oversized_json_line_is_refused(stack):
    long = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]})
    with stack.client() as c:
        r = upload(c, "long.jsonl", f"{json.dumps(GOOD)}\n{long}\n".encode())
    assert r.status_code == 400
    assert r.json()["error"]["issues"] == [{"line": 2, "field": "", "message": "line is over the limit of 4000 bytes"}]


def test_rate_limit_per_key(make_pg_stack):
    stack = make_pg_stack(workers=0, rate_limit_per_minute=60, rate_limit_burst=5)
    with stack.client() as alice, stack.client("bob") as bob:
        codes = [alice.get("/v1/files").status_code for _ in range(7)]
        assert codes[:5] == [200] * 5 and codes[5:] == [429, 429]
        r = alice.get("/v1/files")
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "60 requests per minute" in err["message"]
        assert int(r.headers["retry-after"]) >= 1 and "x-should-retry" not in r.headers
        assert bob.get("/v1/files").status_code == 200  # another key has its own bucket
    with kiln.Client(stack.base_url, stack.keys["alice"]) as c:  # the SDK waits out Retry-After
        assert c.files.list().data == []
    r = httpx.get(f"{stack.base_url}/v1/files", headers={"Authorization": "Bearer sk-kiln-wrong"})
    assert r.status_code == 401  # a bad key is refused before it can spend anyone's budget

    # A second API process: with the counts in Redis (the broker's, by default) both spend one
    # budget; with each process counting for itself, 10 requests would pass here, not 5.
    second = stack.start_api("api2", port := free_port())
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="the second API")
        carol = {"Authorization": f"Bearer {stack.admin('create-key', '--owner', 'carol')}"}
        urls = [stack.base_url, f"http://127.0.0.1:{port}"] * 5
        codes = [httpx.get(f"{u}/v1/files", headers=carol).status_code for u in urls]
        assert sorted(codes) == [200] * 5 + [429] * 5 and codes[:5] == [200] * 5, codes
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=20)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
