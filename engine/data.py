"""Read a chat dataset into token tensors, and batch it deterministically.

Legend: B batch, T tokens, N images in a batch, C channels, H/W pixels.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from engine.tokenizer import ByteTokenizer
from kiln.dataset import DatasetError, DatasetSource, Issue, iter_lines, parse_line

IGNORE = -100


@dataclass
class Sample:
    line: int
    input_ids_T: torch.Tensor  # long
    labels_T: torch.Tensor  # long, IGNORE where no loss
    pixels_NCHW: torch.Tensor  # float, one image per placeholder, in order

    @property
    def targets(self) -> int:
        return int((self.labels_T != IGNORE).sum())


def image_tensor(data: bytes, size: int) -> torch.Tensor:
    """RGB, resized to size x size, scaled to [-1, 1]. Shape [3, size, size]."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB").resize((size, size), Image.BICUBIC)
        raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return raw.view(size, size, 3).permute(2, 0, 1).float().div(127.5).sub(1.0)


def load_samples(path: str | Path, images: str | Path | None, tok: ByteTokenizer, image_size: int,
                 image_tokens: int, max_seq_len: int) -> list[Sample]:
    """Tokenise every example. Raises DatasetError naming line and field for any bad example."""
    source = DatasetSource(Path(path), Path(images) if images else None)
    samples, issues = [], []
    try:
        for n, raw in iter_lines(source.lines()):
            ex, problems = parse_line(n, raw)
            if ex is None:
                issues += problems
                continue
            ids, target = tok.encode_chat(ex, image_tokens)
            if len(ids) > max_seq_len:
                issues.append(Issue(n, "messages", f"example is {len(ids)} tokens, over max_seq_len {max_seq_len}"))
                continue
            pixels = []
            for k, ref in enumerate(ex.images):
                try:
                    pixels.append(image_tensor(source.read_image(ref), image_size))
                except KeyError:
                    issues.append(Issue(n, f"images[{k}]", source.missing_image_message(ref)))
                except Exception as e:
                    issues.append(Issue(n, f"images[{k}]", f"unreadable image: {e}"))
            input_ids = torch.tensor(ids, dtype=torch.long)
            labels = torch.where(torch.tensor(target), input_ids, torch.full_like(input_ids, IGNORE))
            stacked = torch.stack(pixels) if pixels else torch.zeros(0, 3, image_size, image_size)
            samples.append(Sample(n, input_ids, labels, stacked))
    finally:
        source.close()
    if issues:
        raise DatasetError(issues)
    if not samples:
        raise DatasetError([Issue(0, "", "the dataset holds no examples")])
    return samples


def epoch_order(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), so a resumed run sees
    exactly the batches the uninterrupted run would have seen."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(s.input_ids_T) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), T), IGNORE, dtype=torch.long)
    for b, s in enumerate(samples):  # right padding: causal attention never looks at the pads
        ids[b, :len(s.input_ids_T)] = s.input_ids_T
        labels[b, :len(s.labels_T)] = s.labels_T
    pixels = torch.cat([s.pixels_NCHW for s in samples])
    return {"input_ids_BT": ids, "labels_BT": labels, "pixels_NCHW": pixels}
