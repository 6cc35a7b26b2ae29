"""More concurrent clients than the API has threads: every request still answers, none errs.

Before sessions closed on the event loop, 200 clients deadlocked the connection pool (threads
waited for connections held by requests that were waiting for a thread)."""

from __future__ import annotations

from bench.load import run


def test_concurrent_clients_get_no_errors(make_pg_stack, sample):
    stack = make_pg_stack(workers=0, rate_limit_per_minute=0)
    keys = [stack.admin("create-key", "--owner", "alice") for _ in range(4)]
    with stack.client() as c:
        text = "\n".join(l for l in (sample / "train.jsonl").read_text().splitlines() if '"images"' not in l)
        f = c.post("/v1/files", files={"file": ("t.jsonl", text.encode())}, data={"purpose": "fine-tune"}).json()
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"]}).json()
    result = run(stack.base_url, keys, [job["id"]], clients=120, seconds=8)
    assert result["baseline"]["errors"] == 0
    assert result["mix"]["errors"] == 0, result["mix"]["first_errors"]
    assert result["mix"]["count"] > 120 and {r["request"] for r in result["rows"]} == {
        "get job",
        "list events",
        "list files",
        "list jobs",
        "list models",
    }
