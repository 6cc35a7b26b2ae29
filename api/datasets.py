"""Dataset checks the API runs before it stores a file or queues a job.

The line format lives in ``kiln.dataset`` (shared with the engine's reader); here the archive is
checked for unsafe members and every referenced image is opened with Pillow.
"""

from __future__ import annotations

import io
import posixpath
import zipfile
from pathlib import Path

from PIL import Image

from api.errors import Invalid
from api.settings import Settings
from kiln.dataset import DatasetError, DatasetSource, Issue, LengthBound, Report, validate


def image_problem(data: bytes, max_pixels: int) -> str | None:
    """Why an image cannot be used, or None. Only the header is decoded for the size check."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                return f"image is {w}x{h} pixels, over the limit of {max_pixels} pixels"
            img.verify()
    except Exception as e:
        return f"unreadable image: {e}"
    return None


def check_archive(path: Path, settings: Settings) -> None:
    """Reject zips with members that leave the root, too many members, or a zip-bomb size."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise Invalid(f"Not a valid zip archive: {e}", param="file", code="invalid_archive") from e
    with zf:
        infos = zf.infolist()
        if len(infos) > settings.max_archive_members:
            raise Invalid(
                f"Archive has {len(infos)} members, over the limit of {settings.max_archive_members}",
                param="file",
                code="invalid_archive",
            )
        total = 0
        for info in infos:
            name = info.filename
            norm = posixpath.normpath(name.replace("\\", "/"))
            if (
                name.startswith(("/", "\\"))
                or norm == ".."
                or norm.startswith("../")
                or (len(name) > 1 and name[1] == ":")
            ):
                raise Invalid(f"Archive member {name!r} escapes the archive root", param="file", code="invalid_archive")
            total += info.file_size
        if total > settings.max_archive_unpacked_bytes:
            raise Invalid(
                f"Archive unpacks to {total} bytes, over the limit of {settings.max_archive_unpacked_bytes}",
                param="file",
                code="invalid_archive",
            )


def check_dataset(
    source: DatasetSource, settings: Settings, check_paths: bool, tokenize=None, length: LengthBound | None = None
) -> Report:
    """Validate every line; with ``check_paths`` every image must exist and decode; with
    ``tokenize`` (see kiln.dataset.validate) count tokens and flag examples over ``length``."""

    def check_image(ref: str) -> str | None:
        if not ref.startswith("data:") and not check_paths:
            return None
        if not source.has_image(ref):
            return source.missing_image_message(ref)
        return image_problem(source.read_image(ref), settings.max_image_pixels)

    return validate(
        source.lines(settings.max_line_bytes), check_image, settings.max_line_bytes, tokenize=tokenize, length=length
    )


def open_source(data: Path, images: Path | None, param: str) -> DatasetSource:
    try:
        return DatasetSource(data, images)
    except DatasetError as e:
        raise Invalid(str(e), param=param, code="invalid_file") from e


def raise_if_bad(report: Report, param: str, what: str) -> None:
    if report.ok:
        return
    shown = "; ".join(str(i) for i in report.issues[:10])
    more = len(report.issues) - 10
    tail = f" (and {more}{'+' if report.truncated else ''} more)" if more > 0 or report.truncated else ""
    issues = [{"line": i.line, "field": i.field, "message": i.message} for i in report.issues]
    raise Invalid(
        f"Invalid {what}: {shown}{tail}",
        param=param,
        code=f"invalid_{param}",
        extra={"issues": issues, "issues_truncated": report.truncated},
    )


__all__ = ["check_archive", "check_dataset", "open_source", "raise_if_bad", "Issue"]
