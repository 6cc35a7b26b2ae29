"""The S3 store (kiln/s3store.py) against a real S3 server (SeaweedFS, tests/stack.py): content
addressing, multipart transfers, republished folders, deletes, and a second machine (a fresh
cache folder) reading back what the first wrote."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.s3store import S3Store
from kiln.store import LocalStore, open_store
from tests.stack import ROOT

MiB = 1 << 20


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server's endpoint and credentials in the environment, where boto3 reads them."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def url(s3) -> str:
    return f"s3://{s3.bucket()}/team/kiln"


def machine(url: str, cache: Path, **options) -> S3Store:
    store = open_store(url, cache, **options)
    assert isinstance(store, S3Store)
    return store


def upload(store, data: bytes, chunk: int = 64 << 10) -> tuple[str, bool]:
    up = store.upload(limit=1 << 30)
    for i in range(0, len(data), chunk):
        up.write(data[i : i + chunk])
    return up.commit()


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_same_bytes_uploaded_twice_are_one_object(s3, url, tmp_path):
    a, b = machine(url, tmp_path / "a"), machine(url, tmp_path / "b")
    data = b'{"messages": []}\n' * 1000
    sha = hashlib.sha256(data).hexdigest()
    assert upload(a, data) == (sha, True)
    assert upload(b, data) == (sha, False)  # another machine: the bucket has it, nothing is sent
    bucket = url.split("/")[2]
    assert list(s3.keys(bucket)) == [f"team/kiln/objects/{sha[:2]}/{sha}"]
    assert [p.name for p in (tmp_path / "a" / "tmp").iterdir()] == []  # the temp file went into the cache
    fresh = machine(url, tmp_path / "c")
    assert fresh.object_path(sha).read_bytes() == data
    assert not fresh.object_path("0" * 64).exists()  # no such object: a path that does not exist


def test_a_large_file_goes_in_parts_and_round_trips(s3, url, tmp_path):
    store = machine(url, tmp_path / "a", multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    data = os.urandom(11 * MiB + 123)
    sha, created = upload(store, data, chunk=MiB)
    assert created
    bucket, etags = url.split("/")[2], s3.keys(url.split("/")[2])
    assert etags[f"team/kiln/objects/{sha[:2]}/{sha}"].strip('"').endswith("-3")  # a multipart upload's ETag
    assert machine(url, tmp_path / "b").object_path(sha).read_bytes() == data
    with store.publish_file("jobs/j/merged.zip") as path:
        path.write_bytes(data[::-1])
    assert s3.keys(bucket, "team/kiln/artifacts/jobs/j/merged.zip").popitem()[1].strip('"').endswith("-3")
    assert machine(url, tmp_path / "c").path("jobs/j/merged.zip").read_bytes() == data[::-1]


def test_a_damaged_object_is_not_cached(s3, url, tmp_path):
    store = machine(url, tmp_path / "a")
    sha, _ = upload(store, b"right")
    s3.client().put_object(Bucket=url.split("/")[2], Key=f"team/kiln/objects/{sha[:2]}/{sha}", Body=b"wrong")
    fresh = machine(url, tmp_path / "b")
    with pytest.raises(OSError, match="does not match its SHA-256"):
        fresh.object_path(sha)
    assert not (tmp_path / "b" / "objects" / sha[:2] / sha).exists()


def test_a_republished_folder_replaces_the_old_one_everywhere(s3, url, tmp_path):
    writer, reader = machine(url, tmp_path / "w"), machine(url, tmp_path / "r")
    key, bucket = "jobs/j/checkpoints/step-0000005", url.split("/")[2]
    with writer.publish_dir(key) as folder:
        (folder / "adapter.bin").write_bytes(b"A" * 100)
        (folder / "old.txt").write_text("old")
        (folder / "dcp").mkdir()
        (folder / "dcp" / "shard-0").write_bytes(b"s0")
    assert files(reader.path(key)) == {"adapter.bin": b"A" * 100, "old.txt": b"old", "dcp/shard-0": b"s0"}
    assert reader.exists(key) and not reader.exists("jobs/j/checkpoints/step-000000")  # no partial names

    with writer.publish_dir(key) as folder:  # the step re-run after a resume
        (folder / "adapter.bin").write_bytes(b"B" * 100)  # same size, other bytes: the ETag tells
        (folder / "new.txt").write_text("new")
    want = {"adapter.bin": b"B" * 100, "new.txt": b"new"}
    prefix = f"team/kiln/artifacts/{key}/"
    assert sorted(s3.keys(bucket, prefix)) == [prefix + "adapter.bin", prefix + "new.txt"]
    assert files(writer.path(key)) == want
    assert files(reader.path(key)) == want  # the stale files are gone from the other cache too
    assert not (tmp_path / "r" / "artifacts" / key / "dcp").exists()
    assert files(machine(url, tmp_path / "fresh").path(key)) == want

    with writer.publish_file(key) as path:  # a file where a folder was
        path.write_text("one file")
    assert reader.path(key).read_text() == "one file"
    assert sorted(s3.keys(bucket, f"team/kiln/artifacts/{key}")) == [f"team/kiln/artifacts/{key}"]


def test_deletes_reach_the_bucket_and_the_cache(s3, url, tmp_path):
    store, other = machine(url, tmp_path / "a"), machine(url, tmp_path / "b")
    sha, _ = upload(store, b"some dataset")
    assert store.object_path(sha).exists()
    store.delete_object(sha)
    assert not store.object_path(sha).exists()
    assert not other.object_path(sha).exists()
    for job in ("j", "j2"):
        with store.publish_file(f"jobs/{job}/adapter.zip") as path:
            path.write_text(job)
        with store.publish_dir(f"jobs/{job}/checkpoints/step-1") as folder:
            (folder / "a").write_text(job)
    assert other.path("jobs/j/adapter.zip").read_text() == "j"
    store.delete_artifacts("jobs/j")
    assert list(s3.keys(url.split("/")[2])) == [
        "team/kiln/artifacts/jobs/j2/adapter.zip",
        "team/kiln/artifacts/jobs/j2/checkpoints/step-1/a",
    ]
    assert not (tmp_path / "a" / "artifacts" / "jobs" / "j").exists()
    assert not other.path("jobs/j/adapter.zip").exists() and not other.exists("jobs/j")
    assert not (tmp_path / "b" / "artifacts" / "jobs" / "j" / "adapter.zip").exists()
    assert other.path("jobs/j2/checkpoints/step-1/a").read_text() == "j2"


def test_models_sync_from_the_bucket_or_stay_as_made_here(s3, url, tmp_path):
    store = machine(url, tmp_path / "a")
    builtin = store.model_dir("kiln-tiny")
    assert not builtin.exists()  # the bucket has none: the engine writes the built-in model there
    builtin.mkdir(parents=True)
    (builtin / "config.json").write_text("{}")
    assert store.model_dir("kiln-tiny") == builtin and (builtin / "config.json").exists()

    c, bucket = s3.client(), url.split("/")[2]
    for name, body in {"config.json": b"{}", "tokenizer.json": b"tok", "model.safetensors": b"w" * 1000}.items():
        c.put_object(Bucket=bucket, Key=f"team/kiln/models/mine/{name}", Body=body)
    api = machine(url, tmp_path / "api")
    assert sorted(files(api.model_dir("mine", weights=False))) == ["config.json", "tokenizer.json"]
    worker = machine(url, tmp_path / "w")
    assert files(worker.model_dir("mine")) == {
        "config.json": b"{}",
        "tokenizer.json": b"tok",
        "model.safetensors": b"w" * 1000,
    }


def test_an_exports_state_is_seen_across_machines(s3, url, tmp_path):
    """api/exports.py keeps an export's state and archive in the store: the API (one cache) sees
    what a worker (another) wrote, and an archive gone from the bucket shows as missing."""
    from api import exports

    worker, api, job = machine(url, tmp_path / "worker"), machine(url, tmp_path / "api"), "ftjob-s3"
    assert exports.claim(worker, job, "w1")
    assert (exports.read(api, job) or {})["status"] == "running" and not exports.claim(api, job, "w2")
    with worker.publish_file(exports.archive_key(job)) as path:
        path.write_bytes(b"zip")
    exports.finish(worker, job, "w1", status="succeeded", bytes=3)
    state = exports.read(api, job)
    assert state is not None and exports.status(api, state)["status"] == "succeeded"
    assert api.path(exports.archive_key(job)).read_bytes() == b"zip"
    worker.delete_artifacts(exports.archive_key(job))
    assert exports.status(api, state)["error"]["code"] == "archive_missing"


def test_open_store_by_url(s3, tmp_path):
    bucket = s3.bucket()
    store = machine(f"s3://{bucket}/a/b/", tmp_path / "c")
    assert (store.bucket, store.prefix, store.url) == (bucket, "a/b", f"s3://{bucket}/a/b")
    assert machine(f"s3://{bucket}", tmp_path / "c").url == f"s3://{bucket}"
    local = open_store((tmp_path / "store").as_uri())
    assert isinstance(local, LocalStore) and local.root == tmp_path / "store"
    assert isinstance(open_store(tmp_path / "s2"), LocalStore)
    assert open_store(local.url).url == local.url  # what a parallel job's ranks open
    with pytest.raises(ValueError, match="cache"):
        open_store(f"s3://{bucket}")
    with pytest.raises(ValueError, match="file:///path or s3://"):
        open_store("gs://bucket/x")


def test_the_sdk_imports_no_boto3():
    code = "import sys, kiln, kiln.client, kiln.store, kiln.s3store; assert 'boto3' not in sys.modules, 'boto3'"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_parallel_job_opens_the_store_by_its_url(s3, url, tmp_path):
    """engine.launch's ranks open the S3 store again by its URL, sharing the caller's cache: both
    ranks' shards reach the bucket in rank 0's checkpoint folder, where another machine finds
    them. (Resuming from a checkpoint in the bucket: tests/integration/test_s3_flow.py.)"""
    import engine
    from engine.reporting import RecordingReporter
    from kiln.spec import ParallelSpec
    from tests.unit.test_parallel import job

    spec = job(validation_file=None, parallel=ParallelSpec(nproc=2, ep_size=2))
    here = machine(url, tmp_path / "a")
    stopped = engine.train(spec, here, RecordingReporter(stop_after=2))
    assert stopped.status == "stopped"
    key = "jobs/ftjob-par/checkpoints/step-0000002"
    got = files(machine(url, tmp_path / "b").path(key))
    assert {"rng-0.pt", "rng-1.pt", "trainer_state.pt", "adapter_model.safetensors"} <= set(got)
    assert any(name.startswith("dcp/") for name in got)
    assert got == files(here.path(key))  # what the ranks wrote, byte for byte
