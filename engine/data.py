"""The training data pipeline: index a dataset in one streaming pass, read examples back when
their batch comes, group by length, pack short examples into full rows.

A dataset larger than memory trains: the index keeps a byte offset, a token count and a line
number per example (16 bytes), and only the current batch is tokenised and held as tensors.
Everything that decides which examples form a step depends on (seed, epoch) alone, so a resumed
run makes the same steps.

Packing puts several examples in one row. Each token carries its document's number
(``doc_ids_BT``, -1 for padding) and its position within the document (``positions_BT``):
attention stays inside a document and positions restart, so a packed row computes exactly what
its examples would compute alone (a model's recurrent state, KDA's for instance, must reset at
every document start: ``doc_ids_BT`` marks them).

Legend: B rows, T tokens, N images in a batch, C channels, H/W pixels.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from kiln.dataset import (
    DatasetError,
    DatasetSource,
    Example,
    Issue,
    LengthBound,
    bounded_lines,
    mixed_kind,
    parse_line,
)
from kiln.tokenizer import ChatTemplate, Tokenizer, encode_chat

IGNORE = -100
MAX_LINE_BYTES = 8 << 20


@dataclass
class Sample:
    line: int
    input_ids_T: torch.Tensor  # long
    labels_T: torch.Tensor  # long, IGNORE where no loss
    pixels_NCHW: torch.Tensor  # float, one image per placeholder, in order
    rejected: Sample | None = None  # a preference pair's other answer (this Sample: the preferred)

    def __len__(self) -> int:
        return len(self.input_ids_T)

    @property
    def targets(self) -> int:
        """Tokens predicted with loss: the label of the next position is a target."""
        return int((self.labels_T[1:] != IGNORE).sum())


class ImageCache:
    """Decoded, resized images keyed by the SHA-256 of their bytes: an image shared by many
    examples (or seen again next epoch) is decoded once. Least recently used entries go first."""

    def __init__(self, size: int, max_entries: int = 4096):
        self.size, self.max_entries = size, max_entries
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.decoded = 0

    def get(self, data: bytes) -> torch.Tensor:
        key = hashlib.sha256(data).hexdigest()
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        tensor = image_tensor(data, self.size)
        self.decoded += 1
        self._items[key] = tensor
        if len(self._items) > self.max_entries:
            self._items.popitem(last=False)
        return tensor


def image_tensor(data: bytes, size: int) -> torch.Tensor:
    """RGB, resized to size x size, scaled to [-1, 1]. Shape [3, size, size]."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return raw.view(size, size, 3).permute(2, 0, 1).float().div(127.5).sub(1.0)


class Dataset:
    """A JSONL dataset (or the JSONL inside a zip, copied out once to ``workdir`` so it can be
    seeked), indexed in one pass. Raises DatasetError naming line and field for bad examples
    (one over ``length``'s bound among them, with what would fit)."""

    def __init__(
        self,
        path: str | Path,
        images: str | Path | None,
        tok: Tokenizer,
        tpl: ChatTemplate,
        image_size: int,
        image_tokens: int | None,
        length: LengthBound,
        workdir: Path,
        cache: ImageCache | None = None,
    ):
        self.tok, self.tpl, self.image_tokens = tok, tpl, image_tokens
        self.source = DatasetSource(Path(path), Path(images) if images else None)
        self.cache = cache or ImageCache(image_size)
        if self.source.jsonl_member:
            self.jsonl = workdir / f"{Path(path).name}.jsonl"
            with self.source.open_jsonl() as src, open(self.jsonl, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            self.jsonl = Path(path)
        self.offsets, self.lengths, self.lines = array("q"), array("i"), array("i")
        self.pairs: bool | None = None  # preference pairs (DPO) or chat examples; the longer side's length
        issues: list[Issue] = []
        offset = 0
        with open(self.jsonl, "rb") as f:
            for n, raw in enumerate(bounded_lines(f, MAX_LINE_BYTES), 1):
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                ex, problems = parse_line(n, raw, MAX_LINE_BYTES)
                if ex is None:
                    issues += problems
                    continue
                if ex.images and image_tokens is None:
                    issues.append(Issue(n, "images", "the model takes no image input"))
                    continue
                mixed = mixed_kind(self.pairs, ex)
                if mixed:
                    issues.append(Issue(n, "", mixed))
                    continue
                self.pairs = ex.rejected is not None
                try:
                    sides = [ex, ex.other()] if ex.rejected is not None else [ex]
                    ids = max((encode_chat(tok, tpl, e, image_tokens or 0)[0] for e in sides), key=len)
                except ValueError as e:
                    issues.append(Issue(n, "images", str(e)))
                    continue
                too_long = length.problem(len(ids))
                if too_long:
                    issues.append(Issue(n, "messages", too_long))
                    continue
                for k, ref in enumerate(ex.images):
                    if not self.source.has_image(ref):
                        issues.append(Issue(n, f"images[{k}]", self.source.missing_image_message(ref)))
                self.offsets.append(start)
                self.lengths.append(len(ids))
                self.lines.append(n)
        if issues:
            raise DatasetError(issues)
        if not self.offsets:
            raise DatasetError([Issue(0, "", "the dataset holds no examples")])
        self._f = open(self.jsonl, "rb")

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Sample:
        ex, pixels_NCHW = self.example(i)
        sample = self._sample(ex, pixels_NCHW)
        if ex.rejected is not None:
            sample.rejected = self._sample(ex.other(), pixels_NCHW)
        return sample

    def example(self, i: int) -> tuple[Example, torch.Tensor]:
        """Example i as parsed, and its images' pixels [N, 3, size, size]."""
        self._f.seek(self.offsets[i])
        n = self.lines[i]
        ex, problems = parse_line(n, self._f.readline(MAX_LINE_BYTES + 1), MAX_LINE_BYTES)
        if ex is None:
            raise DatasetError(problems)
        pixels = []
        for k, ref in enumerate(ex.images):
            try:
                pixels.append(self.cache.get(self.source.read_image(ref)))
            except Exception as e:
                raise DatasetError([Issue(n, f"images[{k}]", f"unreadable image: {e}")]) from e
        size = self.cache.size
        return ex, torch.stack(pixels) if pixels else torch.zeros(0, 3, size, size)

    def _sample(self, ex: Example, pixels_NCHW: torch.Tensor) -> Sample:
        ids, target = encode_chat(self.tok, self.tpl, ex, self.image_tokens or 0)
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.where(torch.tensor(target), input_ids, torch.full_like(input_ids, IGNORE))
        return Sample(ex.line, input_ids, labels, pixels_NCHW)

    def close(self) -> None:
        self._f.close()
        self.source.close()


def split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Hold out ``fraction`` of the examples for validation, chosen by the seed."""
    if not fraction:
        return list(range(n)), []
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    perm = torch.randperm(n, generator=g).tolist()
    k = max(1, round(n * fraction))
    if k >= n:
        raise ValueError(f"validation_split {fraction} leaves no training examples out of {n}")
    return sorted(perm[k:]), sorted(perm[:k])


def epoch_batches(
    lengths: array, indices: list[int], batch_size: int, seed: int, epoch: int, group_by_length: bool
) -> list[list[int]]:
    """The batches of one epoch. With ``group_by_length``, examples of similar length share a
    batch (sorted within windows of 32 batches, then the batch order is shuffled)."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    if not group_by_length:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    window = batch_size * 32
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: -lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def collate(samples: list[Sample], pad_id: int, pack_to: int | None = None) -> dict[str, torch.Tensor | None]:
    """Pad into rows. With ``pack_to``, consecutive examples share a row of up to that many
    tokens, and the batch carries doc_ids_BT and positions_BT."""
    rows: list[list[Sample]] = []
    for s in samples:
        if pack_to and rows and sum(len(x) for x in rows[-1]) + len(s) <= pack_to:
            rows[-1].append(s)
        else:
            rows.append([s])
    T = max(sum(len(x) for x in row) for row in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    docs = torch.full((len(rows), T), -1, dtype=torch.long)
    pos = torch.zeros((len(rows), T), dtype=torch.long)
    for b, row in enumerate(rows):  # right padding: causal attention never looks at the pads
        at = 0
        for d, s in enumerate(row):
            n = len(s)
            ids[b, at : at + n], labels[b, at : at + n] = s.input_ids_T, s.labels_T
            docs[b, at : at + n], pos[b, at : at + n] = d, torch.arange(n)
            at += n
    pixels = torch.cat([s.pixels_NCHW for row in rows for s in row])  # in token order
    packed = pack_to is not None and any(len(row) > 1 for row in rows)
    return {
        "input_ids_BT": ids,
        "labels_BT": labels,
        "pixels_NCHW": pixels,
        "doc_ids_BT": docs if packed else None,
        "positions_BT": pos if packed else None,
    }
