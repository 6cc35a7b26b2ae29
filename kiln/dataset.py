"""The chat dataset format: parse, normalise and check one JSONL line at a time.

Accepted per line (one JSON object):
- LLaMA-Factory / MindSpeed-MM form: ``{"images": ["images/a.png"], "messages": [{"role": "user",
  "content": "<image>\\nHow many?"}, {"role": "assistant", "content": "1"}]}``
- OpenAI chat fine-tuning form: ``content`` as a list of ``{"type": "text", "text": ...}`` and
  ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` parts.
- Plain text chats: the first form without images.

Both normalise to :class:`Example`: string contents with one ``<image>`` placeholder per image and
the images as references (a path relative to the dataset root, or a ``data:`` URL). Every problem
is an :class:`Issue` naming the line (1-based) and the field, e.g. ``messages[1].role``.
"""

from __future__ import annotations

import base64
import binascii
import json
import posixpath
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

IMAGE_TOKEN = "<image>"
ROLES = ("system", "user", "assistant")
_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif|bmp);base64,(.*)$", re.S)


@dataclass(frozen=True)
class Issue:
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}" if self.line else "file"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class DatasetError(ValueError):
    """A dataset problem; ``issues`` name line and field."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        more = f" (and {len(issues) - 5} more)" if len(issues) > 5 else ""
        super().__init__("; ".join(str(i) for i in issues[:5]) + more)


@dataclass
class Message:
    role: str
    content: str
    weight: int = 1  # 0: shown to the model, not learned (OpenAI's per-message weight)


@dataclass
class Example:
    line: int
    messages: list[Message]
    images: list[str]  # relative paths or data: URLs, in placeholder order
    rejected: list[Message] | None = None  # a preference pair's other answer (messages: the preferred)

    def other(self) -> Example:
        """A preference pair's rejected side as an example of its own (same input and images)."""
        assert self.rejected is not None
        return Example(self.line, self.rejected, self.images)


@dataclass
class Report:
    examples: int = 0
    messages: int = 0
    images: int = 0
    characters: int = 0
    max_characters: int = 0
    tokens: int | None = None  # with a tokenizer: all tokens, the trained ones, and per example
    target_tokens: int | None = None
    max_tokens: int | None = None
    histogram: dict[int, int] = field(default_factory=dict)  # examples by token count, upper bounds 2^k
    issues: list[Issue] = field(default_factory=list)
    truncated: bool = False  # more issues than were kept
    format: str = "chat"  # or "preference": OpenAI's DPO pairs (tokens count both answers)

    @property
    def ok(self) -> bool:
        return not self.issues

    def count(self, tokens: int, targets: int) -> None:
        self.tokens = (self.tokens or 0) + tokens
        self.target_tokens = (self.target_tokens or 0) + targets
        self.max_tokens = max(self.max_tokens or 0, tokens)
        bound = 1 << max(4, (tokens - 1).bit_length())
        self.histogram[bound] = self.histogram.get(bound, 0) + 1

    def stats(self) -> dict:
        out: dict[str, Any] = {
            "format": self.format,
            "examples": self.examples,
            "messages": self.messages,
            "images": self.images,
            "characters": self.characters,
            "max_example_characters": self.max_characters,
        }
        if self.tokens is not None:
            out.update(
                tokens=self.tokens,
                target_tokens=self.target_tokens,
                max_example_tokens=self.max_tokens,
                mean_example_tokens=round(self.tokens / max(self.examples, 1), 1),
                length_histogram=[{"max_tokens": k, "examples": v} for k, v in sorted(self.histogram.items())],
            )
        return out


def image_ref_problem(ref: object) -> str | None:
    """Why an image reference is unusable, or None. Paths may not leave the dataset root."""
    if not isinstance(ref, str) or not ref:
        return "must be a non-empty string (a relative path or a data: URL)"
    if ref.startswith("data:"):
        m = _DATA_URL.match(ref)
        if not m:
            return "data URL must look like data:image/png;base64,..."
        try:
            base64.b64decode(m.group(2), validate=True)
        except (binascii.Error, ValueError):
            return "data URL holds invalid base64"
        return None
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", ref):
        return "remote image URLs are not fetched: inline the image as a data: URL or upload it in a zip"
    norm = posixpath.normpath(ref.replace("\\", "/"))
    if ref.startswith(("/", "\\")) or re.match(r"^[a-zA-Z]:", ref) or norm == ".." or norm.startswith("../"):
        return f"path {ref!r} escapes the dataset root"
    return None


def decode_data_url(ref: str) -> bytes:
    m = _DATA_URL.match(ref)
    assert m, ref
    return base64.b64decode(m.group(2))


def _content_parts(content: list, where: str, issues: list[Issue], line: int) -> tuple[str, list[str]]:
    text, images = [], []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            issues.append(Issue(line, pw, "content part must be an object"))
            continue
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                issues.append(Issue(line, f"{pw}.text", "must be a string"))
                continue
            text.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                issues.append(Issue(line, f"{pw}.image_url.url", "must be a string"))
                continue
            text.append(IMAGE_TOKEN)
            images.append(url)
        else:
            issues.append(
                Issue(line, f"{pw}.type", f"unknown content part type {kind!r}; expected 'text' or 'image_url'")
            )
    return "".join(text), images


def _message(
    line: int, m: object, where: str, issues: list[Issue], prompt: bool = False
) -> tuple[Message, list[str]] | None:
    """One message of a line and the images its content parts carry; problems go to ``issues``.
    ``prompt``: a chat request's message (an empty assistant turn is context, not a target)."""
    if not isinstance(m, dict):
        issues.append(Issue(line, where, "must be an object with role and content"))
        return None
    role = m.get("role")
    if role not in ROLES:
        issues.append(Issue(line, f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}"))
    content = m.get("content")
    found: list[str] = []
    if isinstance(content, list):
        content, found = _content_parts(content, f"{where}.content", issues, line)
    elif not isinstance(content, str):
        issues.append(Issue(line, f"{where}.content", "must be a string or a list of content parts"))
        content = ""
    weight = m.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        issues.append(Issue(line, f"{where}.weight", "must be 0 or 1"))
        weight = 1
    if role == "assistant":
        if not content.strip() and not prompt:
            issues.append(Issue(line, f"{where}.content", "empty assistant turn"))
        if IMAGE_TOKEN in content:
            issues.append(Issue(line, f"{where}.content", f"{IMAGE_TOKEN} belongs in user or system messages"))
    return Message(str(role), content, int(weight)), found


def _messages(
    line: int, msgs: object, where: str, issues: list[Issue], prompt: bool = False
) -> tuple[list[Message], list[str]] | None:
    if not isinstance(msgs, list) or not msgs:
        issues.append(Issue(line, where, "must be a non-empty list of messages"))
        return None
    out, images = [], []
    for i, m in enumerate(msgs):
        got = _message(line, m, f"{where}[{i}]", issues, prompt)
        if got is not None:
            out.append(got[0])
            images += got[1]
    return out, images


def _images(line: int, obj: dict, part_images: list[str], placeholders: int, issues: list[Issue]) -> list[str]:
    images = obj.get("images", [])
    if not isinstance(images, list):
        issues.append(Issue(line, "images", "must be a list of image paths"))
        images = []
    if part_images and images:
        issues.append(Issue(line, "images", "give images either as the images list or as image_url parts, not both"))
    images = images or part_images
    if placeholders != len(images):
        issues.append(Issue(line, "images", f"{placeholders} {IMAGE_TOKEN} placeholder(s) but {len(images)} image(s)"))
    for k, ref in enumerate(images):
        problem = image_ref_problem(ref)
        if problem:
            issues.append(Issue(line, f"images[{k}]", problem))
    return [str(r) for r in images]


def parse_prompt(msgs: object, where: str = "messages") -> tuple[Example | None, list[Issue]]:
    """A chat request's messages (OpenAI's chat completions: the same roles, string contents and
    ``text`` / ``image_url`` parts as a dataset line) as the Example a model continues, or the
    issues that stop it, each naming its field (``messages[1].content[0].image_url.url``; line 0).
    Images come inline only, as ``data:`` URLs; ``<image>`` in a text is a placeholder, as in a
    dataset, so it needs an image of its own; the last message is a user's or a system's (the
    answer starts after it); an empty assistant turn is context."""
    issues: list[Issue] = []
    parsed = _messages(0, msgs, where, issues, prompt=True)
    if parsed is None:
        return None, issues
    messages, images = parsed
    assert isinstance(msgs, list)  # _messages refused anything else
    for i, m in enumerate(msgs):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            url = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str):
                problem = image_ref_problem(url) if url.startswith("data:") else None
                if not url.startswith("data:"):
                    problem = "must be a data: URL (data:image/png;base64,...); image URLs and paths are not fetched"
                if problem:
                    issues.append(Issue(0, f"{where}[{i}].content[{j}].image_url.url", problem))
    placeholders = sum(m.content.count(IMAGE_TOKEN) for m in messages)
    if placeholders != len(images):
        issues.append(
            Issue(
                0,
                where,
                f"{placeholders} {IMAGE_TOKEN} placeholder(s) but {len(images)} image(s): an {IMAGE_TOKEN} in a "
                "text stands for an image_url part's image; send images as image_url parts only",
            )
        )
    if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
        issues.append(
            Issue(
                0,
                f"{where}[{len(msgs) - 1}].role",
                "the last message is the assistant's; end with a user (or system) message: the answer follows it",
            )
        )
    if issues:
        return None, issues
    return Example(0, messages, images), []


PREFERENCE_FIELDS = ("input", "preferred_output", "non_preferred_output")


def mixed_kind(pairs: bool | None, ex: Example) -> str | None:
    """Why ``ex`` cannot join a dataset whose examples so far are preference pairs (``pairs``
    True) or chat examples (False; None: it is the first). One kind per dataset."""
    if pairs is None or pairs == (ex.rejected is not None):
        return None
    return "a chat example among preference pairs" if pairs else "a preference pair among chat examples"


def method_takes(method: str, pairs: bool) -> str | None:
    """Why a dataset of preference pairs (or of chat examples) cannot train with ``method``."""
    if pairs == (method == "dpo"):
        return None
    if method == "dpo":
        return "method dpo takes preference pairs (input, preferred_output, non_preferred_output)"
    return f"method {method} takes chat examples (messages); preference pairs train with method dpo"


def parse_line(line: int, raw: bytes | str, max_line_bytes: int = 8 << 20) -> tuple[Example | None, list[Issue]]:
    """Parse one JSONL line into an Example, or return the issues that stop it. A line with
    OpenAI's preference fields (``input.messages``, ``preferred_output``,
    ``non_preferred_output``) is a preference pair: ``messages`` the input then the preferred
    answer, ``rejected`` the input then the other (the input's assistant turns are context)."""
    if len(raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw) > max_line_bytes:
        return None, [Issue(line, "", f"line is over the limit of {max_line_bytes} bytes")]
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, [Issue(line, "", f"invalid JSON: {e}")]
    if not isinstance(obj, dict):
        return None, [Issue(line, "", "each line must be a JSON object")]
    if any(k in obj for k in PREFERENCE_FIELDS):
        return _preference(line, obj)
    issues: list[Issue] = []
    parsed = _messages(line, obj.get("messages"), "messages", issues)
    if parsed is None:
        return None, issues
    messages, part_images = parsed
    images = _images(line, obj, part_images, sum(m.content.count(IMAGE_TOKEN) for m in messages), issues)
    if not any(m.role == "assistant" and m.weight for m in messages):
        issues.append(Issue(line, "messages", "no assistant message to learn from"))
    if issues:
        return None, issues
    return Example(line, messages, images), []


def _preference(line: int, obj: dict) -> tuple[Example | None, list[Issue]]:
    issues: list[Issue] = []
    inp = obj.get("input")
    if not isinstance(inp, dict):
        return None, [Issue(line, "input", "must be an object with messages")]
    context = _messages(line, inp.get("messages"), "input.messages", issues)
    outputs = []
    for name in PREFERENCE_FIELDS[1:]:
        got = _messages(line, obj.get(name), name, issues)
        if got is not None:
            for i, m in enumerate(got[0]):
                if m.role != "assistant":
                    issues.append(Issue(line, f"{name}[{i}].role", "must be 'assistant'"))
            if got[1]:
                issues.append(Issue(line, name, "images belong in input.messages"))
            outputs.append(got[0])
    if context is None or len(outputs) < 2:
        return None, issues
    head = [Message(m.role, m.content, 0) for m in context[0]]  # the input is context, never a target
    images = _images(line, obj, context[1], sum(m.content.count(IMAGE_TOKEN) for m in head), issues)
    if issues:
        return None, issues
    return Example(line, head + outputs[0], images, rejected=head + outputs[1]), []


def bounded_lines(f: IO[bytes], limit: int) -> Iterator[bytes]:
    """The lines of a binary file, none longer than ``limit + 1`` bytes in memory: an oversized
    line is cut (so parse_line reports it) and the rest of it skipped in chunks."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line


@dataclass(frozen=True)
class LengthBound:
    """The longest example a job takes, one rule for the dataset report, the API and the trainer:
    the job's ``max_seq_len`` when it sets one, else the model's position limit; a model
    without one (``limit`` None: Kimi Linear, KDA + NoPE attention) takes any length that fits.
    A ``max_seq_len`` over the model's limit is a ValueError naming both."""

    model: str
    limit: int | None  # the model's position limit
    requested: int | None = None  # the job's max_seq_len

    def __post_init__(self) -> None:
        if self.requested is not None and self.limit is not None and self.requested > self.limit:
            raise ValueError(
                f"max_seq_len {self.requested} is over {self.model}'s position limit of {self.limit} "
                f"tokens; use at most {self.limit}, or a model without a position limit"
            )

    @property
    def bound(self) -> int | None:
        """The job's bound in tokens; None: any length."""
        return self.requested if self.requested is not None else self.limit

    def problem(self, tokens: int) -> str | None:
        """Why an example of ``tokens`` is too long, and what would fit; None when it fits."""
        bound = self.bound
        if bound is None or tokens <= bound:
            return None
        if self.limit is None:
            fix = f"raise hyperparameters.max_seq_len to {tokens} or more ({self.model} has no position limit)"
        elif tokens <= self.limit:
            fix = f"raise hyperparameters.max_seq_len to {tokens} or more ({self.model} takes up to {self.limit})"
        else:
            fix = f"shorten it: {self.model} takes at most {self.limit} tokens"
        return f"example is {tokens} tokens, over max_seq_len {bound}; {fix}"


def iter_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """Number the lines (1-based) and skip blank ones."""
    for n, raw in enumerate(lines, 1):
        if raw.strip():
            yield n, raw


def validate(
    lines: Iterable[bytes],
    check_image: Callable[[str], str | None] | None = None,
    max_line_bytes: int = 8 << 20,
    max_issues: int = 100,
    tokenize: Callable[[Example], tuple[int, int]] | None = None,
    length: LengthBound | None = None,
) -> Report:
    """Check every line in one pass. ``check_image(ref)`` says why a referenced image is missing
    or unreadable; ``tokenize(example)`` gives (tokens, target tokens), which adds token counts to
    the report and, with ``length``, an issue for every example that is too long."""
    report = Report()
    pairs: bool | None = None  # preference pairs or chat examples: one kind per dataset

    def add(issue: Issue) -> None:
        if len(report.issues) < max_issues:
            report.issues.append(issue)
        else:
            report.truncated = True

    for n, raw in iter_lines(lines):
        ex, issues = parse_line(n, raw, max_line_bytes)
        for issue in issues:
            add(issue)
        if ex is None:
            continue
        if check_image is not None:
            for k, ref in enumerate(ex.images):
                problem = check_image(ref)
                if problem:
                    add(Issue(n, f"images[{k}]", problem))
        mixed = mixed_kind(pairs, ex)
        if mixed:
            add(Issue(n, "", mixed))
            continue
        pairs = ex.rejected is not None
        if tokenize is not None:
            try:
                sides = [tokenize(ex), *([tokenize(ex.other())] if ex.rejected is not None else [])]
            except ValueError as e:
                add(Issue(n, "images", str(e)))
                continue
            tokens = max(t for t, _ in sides)
            problem = length.problem(tokens) if length is not None else None
            if problem:
                add(Issue(n, "messages", problem))
            for t, targets in sides:
                report.count(t, targets)
        chars = sum(len(m.content) for m in ex.messages)
        report.examples += 1
        report.messages += len(ex.messages)
        report.images += len(ex.images)
        report.characters += chars
        report.max_characters = max(report.max_characters, chars)
    if report.examples == 0 and not report.issues:
        add(Issue(0, "", "the dataset holds no examples"))
    report.format = "preference" if pairs else "chat"
    return report


class DatasetSource:
    """Where a dataset's lines and images come from: a JSONL file or a zip holding one, plus an
    optional zip of images beside it. Image paths resolve against the JSONL's folder."""

    def __init__(self, data: Path, images_zip: Path | None = None):
        self.data = Path(data)
        self._zip = zipfile.ZipFile(self.data) if zipfile.is_zipfile(self.data) else None
        self._images = zipfile.ZipFile(images_zip) if images_zip else None
        self.jsonl_member = self._find_jsonl(self._zip) if self._zip else None

    def _find_jsonl(self, zf: zipfile.ZipFile) -> str:
        names = [n for n in zf.namelist() if n.endswith(".jsonl") and not n.startswith("__MACOSX/")]
        if not names:
            raise DatasetError([Issue(0, "", "the archive holds no .jsonl file")])
        if len(names) > 1:
            preferred = [n for n in names if posixpath.basename(n) == "train.jsonl"]
            if len(preferred) != 1:
                listed = ", ".join(names[:5])
                raise DatasetError(
                    [
                        Issue(
                            0, "", f"the archive holds several .jsonl files ({listed}): keep one or name it train.jsonl"
                        )
                    ]
                )
            names = preferred
        return names[0]

    def open_jsonl(self) -> IO[bytes]:
        if self._zip:
            assert self.jsonl_member is not None  # found with the archive
            return self._zip.open(self.jsonl_member)
        return open(self.data, "rb")

    def lines(self, max_line_bytes: int = 8 << 20) -> Iterator[bytes]:
        with self.open_jsonl() as f:
            yield from bounded_lines(f, max_line_bytes)

    def _lookup(self, ref: str) -> tuple[zipfile.ZipFile, str] | None:
        ref = posixpath.normpath(ref.replace("\\", "/"))
        if self._zip:
            assert self.jsonl_member is not None  # found with the archive
            root = posixpath.dirname(self.jsonl_member)
            name = posixpath.join(root, ref) if root else ref
            if name in self._zip.NameToInfo:
                return self._zip, name
        if self._images:
            names = self._images.NameToInfo
            if ref in names:
                return self._images, ref
            tops = {n.split("/", 1)[0] for n in names if "/" in n}
            if len(tops) == 1:  # a zip of a folder: "dataset/images/a.png" for "images/a.png"
                name = f"{tops.pop()}/{ref}"
                if name in names:
                    return self._images, name
        return None

    def has_image(self, ref: str) -> bool:
        return ref.startswith("data:") or self._lookup(ref) is not None

    def read_image(self, ref: str) -> bytes:
        if ref.startswith("data:"):
            return decode_data_url(ref)
        found = self._lookup(ref)
        if found is None:
            raise KeyError(ref)
        archive, name = found
        return archive.read(name)

    def missing_image_message(self, ref: str) -> str:
        if self._zip is None and self._images is None:
            return (
                f"image {ref!r} not found: upload the images as a zip and pass it as images_file, "
                "or upload one zip holding the JSONL and its images"
            )
        return f"image {ref!r} not found in the uploaded archive"

    def close(self) -> None:
        for z in (self._zip, self._images):
            if z:
                z.close()
