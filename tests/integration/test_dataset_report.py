"""The dataset report the API gives before any job: problems by line and field, token counts,
a length histogram and the training tokens and time to expect."""

from __future__ import annotations

import json

from kiln.dataset import parse_line
from kiln.tokenizer import ByteTokenizer, chat_template, encode_chat


def upload(c, name, content):
    r = c.post("/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_report_counts_tokens_like_the_engine(pg_stack, sample):
    with pg_stack.client() as c:
        train = upload(c, "train.jsonl", (sample / "train.jsonl").read_bytes())
        images = upload(c, "images.zip", (sample / "images.zip").read_bytes())
        r = c.get(f"/v1/files/{train}/report", params={"images_file": images, "n_epochs": 2})
    assert r.status_code == 200, r.text
    rep = r.json()
    tok = ByteTokenizer()
    tpl = chat_template(tok)
    lengths, targets = [], 0
    for n, line in enumerate((sample / "train.jsonl").read_bytes().splitlines(), 1):
        ids, target = encode_chat(tok, tpl, parse_line(n, line)[0], 16)
        lengths.append(len(ids))
        targets += sum(target)
    s = rep["stats"]
    assert rep["ok"] and rep["issues"] == [] and rep["model"] == "kiln-tiny"
    assert s["examples"] == 240 and s["images"] == 147
    assert s["tokens"] == sum(lengths) and s["target_tokens"] == targets and s["max_example_tokens"] == max(lengths)
    assert sum(b["examples"] for b in s["length_histogram"]) == 240
    assert all(b["max_tokens"] >= min(lengths) for b in s["length_histogram"])
    assert rep["estimate"]["training_tokens"] == 2 * sum(lengths) and rep["estimate"]["seconds"] > 0


def test_report_lists_problems_and_job_refuses_over_length(pg_stack, sample):
    long = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]}
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    img = {
        "images": ["images/train_0000.png"],
        "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}],
    }
    content = "\n".join(json.dumps(x) for x in (ok, long, img)).encode() + b"\n"
    with pg_stack.client() as c:
        f = upload(c, "mixed.jsonl", content)
        rep = c.get(f"/v1/files/{f}/report", params={"max_seq_len": 100}).json()
        assert not rep["ok"]
        assert {(i["line"], i["field"]) for i in rep["issues"]} == {(2, "messages"), (3, "images[0]")}
        assert "over max_seq_len 100" in rep["issues"][0]["message"]
        r = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", "training_file": f, "hyperparameters": {"max_seq_len": 100}},
        )
        assert r.status_code == 400
        assert "line 2: messages: example is 306 tokens, over max_seq_len 100" in r.json()["error"]["message"]
        assert c.get(f"/v1/files/{f}/report", params={"model": "gpt-x"}).status_code == 400
        assert c.get("/v1/files/file-nope/report").status_code == 404
