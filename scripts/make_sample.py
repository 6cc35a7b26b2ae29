"""Generate the sample dataset in data/sample/ (deterministic): rendered shape images with
counting and colour questions, plus plain-text arithmetic chats; train/validation/test splits.

    python scripts/make_sample.py
"""

from __future__ import annotations

import io
import json
import random
import zipfile
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "data" / "sample"
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SPLITS = {"train": 240, "validation": 40, "test": 40}


def draw(rng: random.Random, shape: str, count: int, color: str) -> Image.Image:
    img = Image.new("RGB", (64, 64), (250, 250, 250))
    d = ImageDraw.Draw(img)
    cells = rng.sample([(x, y) for x in range(3) for y in range(3)], count)
    for cx, cy in cells:
        x0, y0 = 4 + cx * 20 + rng.randint(0, 3), 4 + cy * 20 + rng.randint(0, 3)
        box = (x0, y0, x0 + 13, y0 + 13)
        (d.ellipse if shape == "circle" else d.rectangle)(box, fill=COLORS[color])
    return img


def example(rng: random.Random, split: str, i: int, images: dict[str, bytes]) -> dict:
    kind = rng.random()
    if kind < 0.35:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return {
            "messages": [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
        }
    shape, color, count = rng.choice(["circle", "square"]), rng.choice(list(COLORS)), rng.randint(1, 5)
    name = f"images/{split}_{i:04d}.png"

    buf = io.BytesIO()
    draw(rng, shape, count, color).save(buf, format="PNG", optimize=True)
    images[name] = buf.getvalue()
    if kind < 0.7:
        question, reply = f"How many {shape}s are in the image?", str(count)
    else:
        question, reply = f"What colour are the {shape}s?", color
    return {
        "images": [name],
        "messages": [{"role": "user", "content": f"<image>\n{question}"}, {"role": "assistant", "content": reply}],
    }


def main() -> None:
    rng = random.Random(1234)
    OUT.mkdir(parents=True, exist_ok=True)
    images: dict[str, bytes] = {}
    for split, n in SPLITS.items():
        with open(OUT / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps(example(rng, split, i, images)) + "\n")
    with zipfile.ZipFile(OUT / "images.zip", "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(images):
            info = zipfile.ZipInfo(name, date_time=(2026, 12, 1, 0, 0, 0))
            zf.writestr(info, images[name])
    print(f"wrote {sum(SPLITS.values())} examples and {len(images)} images to {OUT}")


if __name__ == "__main__":
    main()
