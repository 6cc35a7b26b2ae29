"""The object store: a local folder (the embedded default). Standard library only: the API,
the workers and the engine's command line all use it.

- ``objects/ab/abcd…``: uploaded files, content-addressed by SHA-256, written once, never changed.
- ``artifacts/<key>``: what jobs produce (checkpoint folders, adapter zips), published atomically.
- ``models/<name>``: base models (config.json + safetensors).
- ``tmp/``: uploads and artifacts in progress; nothing there is ever read as a result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"upload exceeds the limit of {limit} bytes")
        self.limit = limit


class Upload:
    """A file being received: bytes go to a temp file while being hashed and counted."""

    def __init__(self, store: LocalStore, limit: int):
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
        dest = self.store.object_path(sha)
        if dest.exists():
            self.path.unlink()
            return sha, False
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path, dest)
        return sha, True

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.path.unlink(missing_ok=True)


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tmp = self.root / "tmp"
        for sub in ("objects", "artifacts", "models", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def upload(self, limit: int) -> Upload:
        return Upload(self, limit)

    def object_path(self, sha: str) -> Path:
        assert len(sha) == 64 and all(c in "0123456789abcdef" for c in sha), sha
        return self.root / "objects" / sha[:2] / sha

    def delete_object(self, sha: str) -> None:
        self.object_path(sha).unlink(missing_ok=True)

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    def path(self, key: str) -> Path:
        """The local path of a published artifact."""
        p = (self.root / "artifacts" / key).resolve()
        assert p.is_relative_to(self.root.resolve() / "artifacts"), key
        return p

    @contextmanager
    def publish_dir(self, key: str) -> Iterator[Path]:
        """Yield an empty temp folder; on success it replaces ``key`` in one rename."""
        tmp = Path(tempfile.mkdtemp(dir=self.tmp, prefix="artifact-"))
        try:
            yield tmp
            self._swap_in(tmp, self.path(key))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @contextmanager
    def publish_file(self, key: str) -> Iterator[Path]:
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="artifact-")
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            self._swap_in(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)

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
