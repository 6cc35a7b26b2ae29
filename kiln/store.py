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

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from kiln.storage import ObjectStore, Publishing, TooLarge, Upload, check_sha

__all__ = ["LocalStore", "ObjectStore", "TooLarge", "Upload", "open_store"]


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
