"""The object store in an S3-compatible bucket (``open_store("s3://bucket/prefix", cache_dir)``),
behind the same interface as ``kiln.store.LocalStore``: the same keys under the prefix
(``objects/ab/<sha256>``, ``artifacts/<key>``, ``models/<name>/``), and local paths handed out,
from a cache folder on this machine. Nothing but the bucket is shared between machines.

- ``objects/``: content-addressed, so immutable: a cached copy is always valid; a download is
  checked against its hash. A commit asks first (HEAD), and sends only bytes the bucket lacks.
- ``artifacts/<key>``: a single object or a "folder" of objects under ``<key>/``. ``path`` brings
  the cached copy up to date (each file's ETag and size against the bucket's; files the bucket no
  longer has are removed), as a step re-run after a resume republishes its checkpoint.
  ``publish_dir``/``publish_file`` yield a local temp folder/file; on success it is uploaded, the
  objects of an earlier publication it does not have are deleted, and it becomes the cached
  copy. One object is replaced atomically; a folder is not (S3 has no rename): write the
  database row that names an artifact after it is published, as the trainer's reporter does.
  An empty folder publishes nothing (S3 has no folders).
- ``models/<name>/``: synced like a folder artifact. When the bucket has none, the local folder is
  left as it is: the engine writes a built-in model there (``ensure_builtin``; the same weights
  on every machine), so each machine makes its own.

The cache (``cache_dir``) holds the files under the same keys, ``tmp/`` for uploads and
publications in progress (same file system: files are renamed into place), and ``etags/``, the
ETag and size each cached artifact or model file was fetched at. Downloads land in ``tmp/`` and
are renamed into place, so processes sharing a cache (the ranks of a parallel job, an API's
processes) never see half a file. The cache only grows: remove it, or files from it, at will.

boto3 is imported when a store is opened (the SDK installs without it); the client reads the
endpoint and credentials from the environment as boto3 always does (``AWS_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``).
Large files go through boto3's managed transfer: multipart above ``multipart_threshold``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.storage import Publishing, Upload, check_sha

# what a base model's folder holds besides its config and tokenizer: skipped by model_dir(weights=False)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".distcp")


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as e:  # pragma: no cover - the server extra installs it
        raise ImportError("an s3:// store needs the boto3 package: pip install boto3 (or kiln[server])") from e
    return boto3


def _missing(e: Exception) -> bool:
    """A botocore ClientError that says the object is not there."""
    return getattr(e, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


class S3Store(Publishing):
    def __init__(
        self,
        bucket: str,
        prefix: str,
        cache: Path,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 64 << 20,
        client: Any = None,
    ):
        boto3 = _boto3()
        from boto3.s3.transfer import TransferConfig

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.cache = Path(cache).resolve()
        self.tmp = self.cache / "tmp"
        for sub in ("objects", "artifacts", "models", "tmp", "etags"):
            (self.cache / sub).mkdir(parents=True, exist_ok=True)
        self.client = client or boto3.client("s3")
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, name: str) -> str:
        """The bucket key of a store name (``objects/…``, ``artifacts/…``, ``models/…``)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    # ---- the bucket ------------------------------------------------------------------------------
    def _head(self, name: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as e:
            if _missing(e):
                return None
            raise

    def _list(self, name: str) -> dict[str, tuple[str, int]]:
        """What the bucket holds at ``name``: ``""`` for an object named so, and the path below
        ``name/`` of each object there; each with its ETag and size."""
        base = self._key(name)
        found: dict[str, tuple[str, int]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for o in page.get("Contents", []):
                k = o["Key"]
                if k == base:
                    found[""] = (o["ETag"], o["Size"])
                elif k.startswith(base + "/") and not k.endswith("/"):
                    found[k[len(base) + 1 :]] = (o["ETag"], o["Size"])
        return found

    def _delete(self, names: list[str]) -> None:
        for i in range(0, len(names), 1000):  # DeleteObjects takes up to 1000 keys
            batch = [{"Key": self._key(n)} for n in names[i : i + 1000]]
            out = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if out.get("Errors"):
                raise OSError(f"could not delete from s3://{self.bucket}: {out['Errors'][:3]}")

    def _send(self, path: Path, name: str) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(name), Config=self.transfer)

    def _fetch(self, name: str, dest: Path, check: Callable[[Path], None] | None = None) -> None:
        """Download an object into ``dest`` (renamed into place once complete and checked)."""
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp, prefix="fetch-")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            self.client.download_file(self.bucket, self._key(name), tmp_name, Config=self.transfer)
            if check is not None:
                check(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    # ---- the cache -------------------------------------------------------------------------------
    def _tag(self, local: Path) -> Path:
        """Where the ETag and size a cached file was fetched at are written."""
        return self.cache / "etags" / local.relative_to(self.cache)

    def _drop(self, local: Path) -> None:
        """Remove a cached file or folder and what is known of it."""
        for p in (self._tag(local), local):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _remember(self, local: Path, etag: str, size: int) -> None:
        tag = self._tag(local)
        if tag.is_dir():
            shutil.rmtree(tag, ignore_errors=True)
        tag.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix="etag-")
        with os.fdopen(fd, "w") as f:
            f.write(f"{etag} {size}")
        os.replace(tmp, tag)

    def _current(self, local: Path, etag: str, size: int) -> bool:
        tag = self._tag(local)
        try:
            return local.is_file() and local.stat().st_size == size and tag.read_text() == f"{etag} {size}"
        except OSError:
            return False

    def _sync_file(self, name: str, local: Path, etag: str, size: int) -> None:
        if self._current(local, etag, size):
            return
        if local.is_dir():
            self._drop(local)
        self._tag(local).unlink(missing_ok=True)  # a crash before _remember leaves it untrusted
        self._fetch(name, local)
        self._remember(local, etag, size)

    def _sync(
        self,
        name: str,
        local: Path,
        listed: dict[str, tuple[str, int]],
        keep: Callable[[str], bool] = lambda rel: True,
        prune: bool = True,
    ) -> None:
        """Bring the cached copy of ``name`` up to date with what the bucket holds there
        (``listed``: an object, or the objects under ``name/``); ``prune``: remove cached files
        the bucket no longer has, all of them when it has nothing there."""
        if "" in listed:  # one object
            self._sync_file(name, local, *listed[""])
            return
        if not listed or local.is_file() or local.is_symlink():
            if prune or listed:
                self._drop(local)
            if not listed:
                return
        if prune and local.is_dir():
            for p in sorted(local.rglob("*"), reverse=True):  # a folder's files before the folder
                rel = p.relative_to(local).as_posix()
                if p.is_dir() and not p.is_symlink():
                    if not any(k.startswith(rel + "/") for k in listed):
                        self._drop(p)
                elif rel not in listed:
                    self._drop(p)
        for rel, (etag, size) in listed.items():
            if keep(rel):
                self._sync_file(f"{name}/{rel}", local / rel, etag, size)

    def _artifact(self, key: str) -> tuple[Path, str]:
        """The cached path of an artifact key, and its store name (``artifacts/…``, normalised)."""
        root = self.cache / "artifacts"
        p = (root / key).resolve()
        assert p.is_relative_to(root) and p != root, key
        return p, f"artifacts/{p.relative_to(root).as_posix()}"

    # ---- the interface (kiln.store.ObjectStore) --------------------------------------------------
    def upload(self, limit: int) -> Upload:
        return Upload(self, limit)

    def put_object(self, path: Path, sha: str) -> bool:
        name, dest = f"objects/{check_sha(sha)[:2]}/{sha}", self.object_path(sha)
        created = self._head(name) is None
        if created:
            self._send(path, name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)  # the same bytes: cached for the reads to come
        return created

    def object_path(self, sha: str) -> Path:
        """The object's local copy, downloaded on first use; a path that does not exist when the
        bucket has no such object."""
        from botocore.exceptions import ClientError

        dest = self.cache / "objects" / check_sha(sha)[:2] / sha
        if dest.exists():
            return dest

        def check(p: Path) -> None:
            h = hashlib.sha256()
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            if h.hexdigest() != sha:
                raise OSError(f"object {sha} from s3://{self.bucket} does not match its SHA-256")

        try:
            self._fetch(f"objects/{sha[:2]}/{sha}", dest, check)
        except ClientError as e:
            if not _missing(e):
                raise
        return dest

    def delete_object(self, sha: str) -> None:
        self._delete([f"objects/{check_sha(sha)[:2]}/{sha}"])
        (self.cache / "objects" / sha[:2] / sha).unlink(missing_ok=True)

    def model_dir(self, name: str, weights: bool = True) -> Path:
        """The base model's folder, synced from ``models/<name>/``; left as it is when the bucket
        has none (a built-in model the engine writes there). ``weights=False``: the small files
        only (config, tokenizer), for the API's token counts."""
        assert name and "/" not in name and name not in (".", ".."), name
        local = self.cache / "models" / name
        listed = {rel: v for rel, v in self._list(f"models/{name}").items() if rel}
        if listed:
            keep = (lambda rel: True) if weights else (lambda rel: not rel.endswith(WEIGHT_SUFFIXES))
            self._sync(f"models/{name}", local, listed, keep, prune=weights)
        return local

    def path(self, key: str) -> Path:
        """The local copy of a published artifact (a file or a folder), brought up to date; a path
        that does not exist when nothing is published at ``key``."""
        local, name = self._artifact(key)
        self._sync(name, local, self._list(name))
        return local

    def exists(self, key: str) -> bool:
        return bool(self._list(self._artifact(key)[1]))

    def _place(self, src: Path, key: str) -> None:
        """A finished publication: its files replace whatever ``key`` held, in the bucket and here."""
        local, name = self._artifact(key)
        if src.is_dir():
            files = {p.relative_to(src).as_posix(): p for p in sorted(src.rglob("*")) if p.is_file()}
        else:
            files = {"": src}
        for rel, p in files.items():
            self._send(p, f"{name}/{rel}" if rel else name)
        listed = self._list(name)
        self._delete([f"{name}/{rel}" if rel else name for rel in listed if rel not in files])
        self._drop(local)  # the new files become the cached copy
        local.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, local)
        for rel in files:
            if rel in listed:
                self._remember(local / rel if rel else local, *listed[rel])

    def delete_artifacts(self, prefix: str) -> None:
        local, name = self._artifact(prefix)
        self._delete([f"{name}/{rel}" if rel else name for rel in self._list(name)])
        self._drop(local)
