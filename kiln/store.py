"""The object store: a local folder (the embedded default) or an S3-compatible bucket
(``kiln.s3store``), chosen by a URL (``open_store``). Standard library only: the API, the workers
and the engine's command line all use it; the S3 store imports boto3 when one is opened.

- ``objects/ab/abcd…``: uploaded files, content-addressed by SHA-256, written once, never changed.
- ``artifacts/<key>``: what jobs produce (checkpoint folders, adapter zips), published atomically.
- ``models/<name>``: base models (config.json + safetensors).
- ``tmp/``: uploads and artifacts in progress; nothing there is ever read as a result.

Both stores hand out local paths: the S3 store keeps a local cache folder of what it was asked
for (``kiln.s3store``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit


class TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"upload exceeds the limit of {limit} bytes")
        self.limit = limit


class Upload:
    """A file being received: bytes go to a temp file while being hashed and counted."""

    def __init__(self, store: ObjectStore, limit: int):
        self.store, self.limit = store, limit
        fd, name = tempfile.mkstemp(dir=store.tmp, prefix="upload-")
        self.path = Path(name)
        self._f = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise TooLarge(self.limit)
        self._hash.update(chunk)
        self._f.write(chunk)

    def sha256(self) -> str:
        """The hash of the bytes received so far (all of them once the upload is received)."""
        return self._hash.hexdigest()

    def finish(self) -> None:
        """Flush to disk; the temp file can then be read for validation."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def commit(self) -> tuple[str, bool]:
        """Move into the content-addressed area. Returns (sha256, created)."""
        if not self._f.closed:
            self.finish()
        sha = self._hash.hexdigest()
        return sha, self.store.put_object(self.path, sha)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.path.unlink(missing_ok=True)


class ObjectStore(Protocol):
    """What the API and the workers use (the engine needs less: ``engine.spec.Store``). Every
    path handed out is local; ``tmp`` is a folder on the same file system as the store's."""

    tmp: Path

    @property
    def url(self) -> str:
        """Opens the same store again (``open_store``), in another process: ``file:///…`` or ``s3://…``."""
        ...

    def upload(self, limit: int) -> Upload: ...
    def put_object(self, path: Path, sha: str) -> bool:
        """Keep a received temp file (consumed) as the object ``sha``; False: it was there already."""
        ...

    def object_path(self, sha: str) -> Path: ...
    def delete_object(self, sha: str) -> None: ...
    def model_dir(self, name: str, weights: bool = True) -> Path: ...
    def path(self, key: str) -> Path: ...
    def exists(self, key: str) -> bool: ...
    def publish_dir(self, key: str) -> AbstractContextManager[Path]: ...
    def publish_file(self, key: str) -> AbstractContextManager[Path]: ...
    def delete_artifacts(self, prefix: str) -> None: ...


def check_sha(sha: str) -> str:
    assert len(sha) == 64 and all(c in "0123456789abcdef" for c in sha), sha
    return sha


def open_store(url: str | Path, cache_dir: Path | None = None, **options: Any) -> ObjectStore:
    """The store a URL names: a folder (``file:///path``, or a plain path) or an S3 bucket
    (``s3://bucket/prefix``: endpoint and credentials from the environment as boto3 reads them,
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``;
    what it hands out is kept in ``cache_dir``). ``options`` go to ``S3Store``."""
    text = str(url)
    parts = urlsplit(text)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"{text!r}: an S3 store URL names its bucket: s3://bucket/prefix")
        if cache_dir is None:
            raise ValueError("an S3 store needs a local cache folder")
        from kiln.s3store import S3Store

        return S3Store(parts.netloc, parts.path.strip("/"), cache_dir, **options)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{text!r}: a file URL names a local folder: file:///path")
        return LocalStore(Path(unquote(parts.path)))
    if parts.scheme and len(parts.scheme) > 1:  # one letter: a Windows drive, a path
        raise ValueError(f"{text!r}: the store is a folder, file:///path or s3://bucket/prefix")
    return LocalStore(Path(text))


class Publishing:
    """``publish_dir`` / ``publish_file``: a temp folder or file in the store's ``tmp``, handed to
    the store's ``_place`` when the block succeeds, removed either way."""

    tmp: Path

    def _place(self, tmp: Path, key: str) -> None:
        raise NotImplementedError

    @contextmanager
    def publish_dir(self, key: str) -> Iterator[Path]:
        tmp = Path(tempfile.mkdtemp(dir=self.tmp, prefix="artifact-"))
        try:
            yield tmp
            self._place(tmp, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextmanager
    def publish_file(self, key: str) -> Iterator[Path]:
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="artifact-")
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            self._place(tmp, key)
        finally:
            tmp.unlink(missing_ok=True)


class LocalStore(Publishing):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        for sub in ("objects", "artifacts", "models", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.root.resolve().as_uri()

    def upload(self, limit: int) -> Upload:
        return Upload(self, limit)

    def put_object(self, path: Path, sha: str) -> bool:
        dest = self.object_path(sha)
        if dest.exists():
            path.unlink()
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return True

    def object_path(self, sha: str) -> Path:
        return self.root / "objects" / check_sha(sha)[:2] / sha

    def delete_object(self, sha: str) -> None:
        self.object_path(sha).unlink(missing_ok=True)

    def model_dir(self, name: str, weights: bool = True) -> Path:
        """A base model's folder. ``weights=False``: only its small files are needed (config,
        tokenizer); a remote store then fetches no weights."""
        return self.root / "models" / name

    def path(self, key: str) -> Path:
        """The local path of a published artifact."""
        p = (self.root / "artifacts" / key).resolve()
        assert p.is_relative_to(self.root.resolve() / "artifacts"), key
        return p

    def exists(self, key: str) -> bool:
        """Whether an artifact is published (a remote store checks without fetching it)."""
        return self.path(key).exists()

    def _place(self, tmp: Path, key: str) -> None:
        """A finished publication replaces ``key`` in one rename."""
        self._swap_in(tmp, self.path(key))

    def _swap_in(self, tmp: Path, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():  # a step re-run after a resume: the new result replaces the old
            old = Path(tempfile.mkdtemp(dir=self.tmp, prefix="old-"))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)

    def delete_artifacts(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix), ignore_errors=True)
