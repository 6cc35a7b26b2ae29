"""Schemathesis against the OpenAPI spec of the running server, every check (``--checks all``): no
input gives a 5xx, every status and body is the one the spec declares, schema-valid requests are
accepted, schema-invalid ones refused, undeclared methods answer 405 with a full ``Allow``.

Real ids (a finished job, its checkpoint, a file, a spare key) are given to the fuzzer so that it
reaches past the 404s into the handlers. Three allowances, stated in the config below, for rules
no JSON Schema states: an upload's *content* (a JSONL dataset in Kiln's format, or a zip), a
job's settings against each other and against its model (``parallel.ep_size`` divides ``nproc``
and the model's experts, the LoRA targets are the model's, ``max_seq_len`` within its position
limit), and a chat request's messages and settings against its model (images on a text-only
model, a max_tokens over the position limit, the last turn a user's): a schema-valid request
that breaks one is a 400 naming the field. This stack runs no inference server (the fuzzer
would ask for answers of up to 32768 tokens), so a chat request that passes every check is a
503 saying the server is not reachable (tests/integration/test_chat.py has the answers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import wait_for
from tests.stack import free_port

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_the_server_keeps_to_its_spec(make_pg_stack, tmp_path):
    stack = make_pg_stack(rate_limit_per_minute=0)
    with stack.client() as c:
        f = c.post(
            "/v1/files",
            files={"file": ("a.jsonl", (json.dumps(GOOD) + "\n").encode() * 4)},
            data={"purpose": "fine-tune"},
        ).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", "training_file": f["id"], "hyperparameters": {"max_steps": 2, "batch_size": 2}},
        ).json()
        job = wait_for(
            lambda: (j := c.get(f"/v1/fine_tuning/jobs/{job['id']}").json())["status"] == "succeeded" and j, what="job"
        )
        ckpt = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][0]
        spare = c.post("/v1/keys", json={"name": "spare"}).json()
        nobody = f"http://127.0.0.1:{free_port()}/hook"  # the webhook worker's attempts are refused at once
        hook = c.post("/v1/webhooks", json={"url": nobody}).json()
        doomed_hook = c.post("/v1/webhooks", json={"url": nobody}).json()  # what DELETE /v1/webhooks/{webhook_id} gets
        doomed = c.post(  # what DELETE /v1/files/{file_id} gets: the file the other routes read stays
            "/v1/files", files={"file": ("b.jsonl", (json.dumps(GOOD) + "\n").encode())}, data={"purpose": "fine-tune"}
        ).json()
    config = tmp_path / "schemathesis.toml"
    # schemathesis's cache (crashes and observations that later runs replay) and, by the working
    # directory, hypothesis's example database in this test's own folder: every run starts from
    # none, as on a fresh checkout (the seed fixes the rest), and none is written into the repository
    config.write_text(f'''
[cache]
directory = "{tmp_path / "schemathesis-cache"}"

[parameters]
"path.job_id" = "{job["id"]}"
"path.file_id" = "{f["id"]}"
"path.ckpt_id" = "{ckpt["id"]}"
"path.key_id" = "{spare["id"]}"
"path.model_id" = "{job["fine_tuned_model"]}"
"path.webhook_id" = "{hook["id"]}"

[[operations]]
include-name = "DELETE /v1/files/{{file_id}}"
parameters = {{ "path.file_id" = "{doomed["id"]}" }}

[[operations]]
include-name = "DELETE /v1/webhooks/{{webhook_id}}"
parameters = {{ "path.webhook_id" = "{doomed_hook["id"]}" }}

[[operations]]
include-name = "POST /v1/webhooks"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "409", "429"]

[[operations]]
include-name = "POST /v1/files"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "409", "413", "429"]

[[operations]]
include-name = "POST /v1/fine_tuning/jobs"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429"]

[[operations]]
include-name = "POST /v1/chat/completions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "409", "429", "503"]
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
''')
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"),
            "--config-file",
            str(config),
            "run",
            f"{stack.base_url}/openapi.json",
            "-H",
            f"Authorization: Bearer {stack.keys['alice']}",
            "--checks",
            "all",
            "--max-examples",
            "40",
            "--request-timeout",
            "20",
            "--seed",
            "20261202",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1].lower()
    with stack.client() as c:  # the service still works after the fuzzing
        assert c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "succeeded"
