"""Beyond supervised LoRA (#35): DPO through the openai SDK, continued training from a checkpoint
(exactly the steps the first job would have taken next) and from a finished fine-tune's
adapter, and the refusals (the wrong kind of data, another owner's model, a changed adapter)."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.conftest import all_events, finished


def pair(a: int, b: int) -> dict:
    return {
        "input": {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}]},
        "preferred_output": [{"role": "assistant", "content": str(a + b)}],
        "non_preferred_output": [{"role": "assistant", "content": str(a + b + 7)}],
    }


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack()


@pytest.fixture(scope="module")
def files(stack, sample):
    with stack.client() as c:
        up = lambda name, content: c.post(
            "/v1/files", files={"file": (name, content)}, data={"purpose": "fine-tune"}
        ).json()["id"]
        prefs = "".join(json.dumps(pair(a, b)) + "\n" for a in range(6) for b in range(4))
        return {
            "prefs": up("prefs.jsonl", prefs.encode()),
            "train": up("train.jsonl", (sample / "train.jsonl").read_bytes()),
            "images": up("images.zip", (sample / "images.zip").read_bytes()),
        }


def metrics(c, job_id: str) -> dict[int, dict]:
    return {e["data"]["step"]: e["data"] for e in all_events(c, job_id) if e["type"] == "metrics"}


def test_dpo_through_the_openai_sdk(stack, files):
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.keys["alice"], max_retries=0)
    job = client.fine_tuning.jobs.create(
        model="kiln-tiny",
        training_file=files["prefs"],
        validation_file=files["prefs"],
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.5, "n_epochs": 2, "batch_size": 8}}},
    )
    assert job.method is not None and job.method.type == "dpo"
    with stack.client() as c:
        done = finished(c, job.id)
        assert done["status"] == "succeeded", done["error"]
        assert done["method"]["dpo"]["hyperparameters"]["beta"] == 0.5
        steps = metrics(c, job.id)
        assert sorted(steps) == list(range(1, 7))
        assert {"rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin"} <= set(steps[1])
        assert "valid_reward_accuracy" in steps[6]
    with pytest.raises(BadRequestError, match="takes chat examples"):
        client.fine_tuning.jobs.create(model="kiln-tiny", training_file=files["prefs"])
    with pytest.raises(BadRequestError, match="takes preference pairs"):
        client.fine_tuning.jobs.create(
            model="kiln-tiny",
            training_file=files["train"],
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
            extra_body={"images_file": files["images"]},
        )
    with pytest.raises(BadRequestError, match="method dpo runs in one process"):
        client.fine_tuning.jobs.create(
            model="kiln-tiny",
            training_file=files["prefs"],
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
            extra_body={"hyperparameters": {"parallel": {"nproc": 2}}},
        )
    with pytest.raises(BadRequestError, match="hyperparameters.beta is DPO's"):
        client.fine_tuning.jobs.create(
            model="kiln-tiny",
            training_file=files["train"],
            method={"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}},  # type: ignore[typeddict-unknown-key]
            extra_body={"images_file": files["images"]},
        )


def test_a_job_continued_from_a_checkpoint_takes_the_next_steps_exactly(stack, files):
    body = {
        "training_file": files["train"],
        "images_file": files["images"],
        "seed": 4,
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "max_steps": 8, "checkpoint_interval": 4},
    }
    with stack.client() as c:
        first = finished(c, c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **body}).json()["id"])
        assert first["status"] == "succeeded"
        ckpt = next(
            k for k in c.get(f"/v1/fine_tuning/jobs/{first['id']}/checkpoints").json()["data"] if k["step_number"] == 4
        )
        for start in (ckpt["id"], ckpt["fine_tuned_model_checkpoint"]):
            job = c.post("/v1/fine_tuning/jobs", json={"model": start, **body}).json()
            assert job["model"] == "kiln-tiny" and job["requested"]["from"]["step"] == 4
            done = finished(c, job["id"])
            assert done["status"] == "succeeded", done["error"]
            later = metrics(c, job["id"])
            assert sorted(later) == [5, 6, 7, 8]
            assert "Resumed from the checkpoint at step 4" in [e["message"] for e in all_events(c, job["id"])]
            assert {s: m["train_loss"] for s, m in later.items()} == {
                s: m["train_loss"] for s, m in metrics(c, first["id"]).items() if s > 4
            }
        # from the finished fine-tune: its adapter, a fresh run of its own
        more = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": first["fine_tuned_model"], **body, "hyperparameters": {"max_steps": 2}},
        ).json()
        done = finished(c, more["id"])
        assert done["status"] == "succeeded" and sorted(metrics(c, more["id"])) == [1, 2]
        assert any(e["message"].startswith("Started from the adapter") for e in all_events(c, more["id"]))
        r = c.post("/v1/fine_tuning/jobs", json={"model": first["fine_tuned_model"], **body, "lora": {"rank": 32}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora.rank"
    with stack.client("bob") as bob:
        for theirs in (first["fine_tuned_model"], ckpt["id"], ckpt["fine_tuned_model_checkpoint"]):
            r = bob.post("/v1/fine_tuning/jobs", json={"model": theirs, "training_file": "file-x"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", theirs
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.keys["bob"], max_retries=0)
    with pytest.raises(NotFoundError):
        client.fine_tuning.jobs.create(model="ft:kiln-tiny:nobody::abc", training_file="file-x")
