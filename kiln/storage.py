"""What both object stores share (``kiln.store.LocalStore``, ``kiln.s3store.S3Store``): the
interface the API and the workers use, an upload being received and hashed, and publishing
through a temp folder or file. Standard library only."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol


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
