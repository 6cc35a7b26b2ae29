from __future__ import annotations

import base64
import io
import json
import zipfile

from PIL import Image

from kiln.dataset import DatasetSource, parse_line, validate


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def test_three_forms_normalise_to_the_same_example():
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    llama_factory = {
        "images": [url],
        "messages": [{"role": "user", "content": "<image>\nHow many?"}, {"role": "assistant", "content": "1"}],
    }
    openai_parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "\nHow many?"}],
            },
            {"role": "assistant", "content": "1"},
        ]
    }
    a, issues_a = parse_line(1, json.dumps(llama_factory))
    b, issues_b = parse_line(1, json.dumps(openai_parts))
    assert not issues_a and not issues_b
    assert a == b and a.images == [url] and a.messages[0].content == "<image>\nHow many?"
    text, issues = parse_line(
        3,
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hey", "weight": 0},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        ),
    )
    assert not issues and [m.weight for m in text.messages] == [1, 1, 0, 1] and text.images == []


def test_every_problem_of_a_line_is_reported_with_its_field():
    line = {
        "images": ["/abs.png"],
        "messages": [{"role": "robot", "content": 5}, {"role": "assistant", "content": "<image>", "weight": 2}],
    }
    ex, issues = parse_line(7, json.dumps(line))
    assert ex is None
    got = {(i.line, i.field) for i in issues}
    assert {
        (7, "messages[0].role"),
        (7, "messages[0].content"),
        (7, "messages[1].weight"),
        (7, "messages[1].content"),
        (7, "images[0]"),
    } <= got
    assert str(issues[0]).startswith("line 7: messages[0].role: unknown role 'robot'")


def test_validate_counts_and_limits():
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).encode()
    report = validate([good, b"\n", good, b"x" * 100], max_line_bytes=90)
    assert report.examples == 2 and report.messages == 4
    assert [(i.line, i.message) for i in report.issues] == [(4, "line is over the limit of 90 bytes")]
    empty = validate([b"\n", b"  \n"])
    assert not empty.ok and "no examples" in str(empty.issues[0])
    many = validate([b"{"] * 150, max_issues=100)
    assert len(many.issues) == 100 and many.truncated


def test_images_resolve_in_archive_and_in_a_zipped_folder(tmp_path):
    line = json.dumps(
        {
            "images": ["images/a.png"],
            "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "red"}],
        }
    )
    ds = tmp_path / "ds.zip"
    with zipfile.ZipFile(ds, "w") as zf:
        zf.writestr("set/train.jsonl", line + "\n")
        zf.writestr("set/images/a.png", png())
    source = DatasetSource(ds)
    assert source.jsonl_member == "set/train.jsonl"
    assert source.read_image("images/a.png") == png() and not source.has_image("images/b.png")
    jl = tmp_path / "train.jsonl"
    jl.write_text(line + "\n")
    imgs = tmp_path / "imgs.zip"
    with zipfile.ZipFile(imgs, "w") as zf:
        zf.writestr("myfolder/images/a.png", png())
    assert DatasetSource(jl, imgs).read_image("images/a.png") == png()
    lonely = DatasetSource(jl)
    assert not lonely.has_image("images/a.png") and "images_file" in lonely.missing_image_message("images/a.png")


def test_an_oversized_line_is_never_held_whole(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write(good + "\n" + "x" * 5_000_000 + "\n" + good + "\n")
    lines = list(DatasetSource(path).lines(max_line_bytes=1000))
    assert [len(x) for x in lines] == [len(good) + 1, 1001, len(good) + 1]
    report = validate(lines, max_line_bytes=1000)
    assert report.examples == 2 and [(i.line, i.message) for i in report.issues] == [
        (2, "line is over the limit of 1000 bytes")
    ]
