"""A fine-tune of the built-in Kimi Linear model through the service: KDA + MLA + MoE, LoRA on
attention and on every expert, packed text, an adapter in PEFT's layout."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from safetensors.numpy import load as load_safetensors

from tests.conftest import all_events, finished


def test_kimi_linear_tiny_job(pg_stack, sample):
    """On two processes (the worker starts torchrun; gloo here), the experts split two ways."""
    text = "\n".join(l for l in (sample / "train.jsonl").read_text().splitlines() if '"images"' not in l)
    with pg_stack.client() as c:
        f = c.post("/v1/files", files={"file": ("text.jsonl", text.encode())}, data={"purpose": "fine-tune"}).json()
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kimi-linear-tiny",
                "training_file": f["id"],
                "seed": 1,
                "hyperparameters": {
                    "n_epochs": 1,
                    "batch_size": 8,
                    "learning_rate_multiplier": 2,
                    "parallel": {"nproc": 2, "ep_size": 2},
                },
                "lora": {"rank": 4, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
            },
        ).json()
        done = finished(c, job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        losses = [
            e["data"]["train_loss"]
            for e in sorted(all_events(c, job["id"]), key=lambda e: e["created_at"])
            if e["type"] == "metrics"
        ]
        assert len(losses) == 12 and sum(losses[-3:]) / 3 < losses[0]
        messages = [e["message"] for e in all_events(c, job["id"])]
        assert "Parallel: 2 processes, FSDP2 over all, experts split 2 ways" in messages
        ckpts = c.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        assert ckpts and all(k["metrics"]["step"] > 0 for k in ckpts)
        r = c.get(f"/v1/fine_tuning/jobs/{job['id']}/adapter")
    zf = zipfile.ZipFile(io.BytesIO(r.content))
    cfg = json.loads(zf.read("adapter_config.json"))
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    keys = set(load_safetensors(zf.read("adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in keys


def test_text_only_model_refuses_images_naming_the_line(pg_stack, sample):
    with pg_stack.client() as c:
        f = c.post(
            "/v1/files",
            files={"file": ("t.jsonl", (sample / "train.jsonl").read_bytes())},
            data={"purpose": "fine-tune"},
        ).json()
        images = c.post(
            "/v1/files", files={"file": ("i.zip", (sample / "images.zip").read_bytes())}, data={"purpose": "fine-tune"}
        ).json()
        r = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kimi-linear-tiny", "training_file": f["id"], "images_file": images["id"]},
        )
    assert r.status_code == 400
    assert "line 1: images: kimi-linear-tiny takes no image input" in r.json()["error"]["message"]


def test_hybrid_tiny_job_with_images(pg_stack, sample):
    """The K3-style hybrid (KDA + Gated DSA + LatentMoE + AttnRes + images) through the service,
    with Swap Core keeping the matmul outputs in host memory."""
    with pg_stack.client() as c:
        up = lambda n: c.post(
            "/v1/files", files={"file": (n, (sample / n).read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-hybrid-tiny",
                "training_file": up("validation.jsonl"),
                "images_file": up("images.zip"),
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 8,
                    "memory": {"recompute": "selective", "tier": "host", "cache_ops": ["mm", "grouped_mm"]},
                },
                "lora": {"rank": 4, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
            },
        ).json()
        done = finished(c, job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        assert done["method"]["supervised"]["hyperparameters"]["memory"]["tier"] == "host"
        events = c.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]
        r = c.get(f"/v1/fine_tuning/jobs/{job['id']}/adapter")
    assert any(
        e["message"].startswith("Recompute: selective, keeping mm, grouped_mm outputs on the host tier") for e in events
    )
    assert any(e["type"] == "metrics" and e["data"].get("swap_host_mb", 0) > 0 for e in events)
    keys = set(load_safetensors(zipfile.ZipFile(io.BytesIO(r.content)).read("adapter_model.safetensors")))
    assert "base_model.model.layers.3.self_attn.q_b_proj.lora_A.weight" in keys  # the Gated DSA block
    assert "base_model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in keys


def short_file(c, lines: list[str]) -> str:
    return c.post(
        "/v1/files", files={"file": ("short.jsonl", "\n".join(lines).encode())}, data={"purpose": "fine-tune"}
    ).json()["id"]


def long_document(tokens: int) -> dict:
    """A chat of about ``tokens`` byte-level tokens (the built-in models' tokenizer: one a byte)."""
    story = " ".join(f"w{i % 97}" for i in range(tokens // 4))[: tokens - 40]
    return {
        "messages": [{"role": "user", "content": "Retell: " + story}, {"role": "assistant", "content": story[-200:]}]
    }


def test_a_document_longer_than_4096_tokens_trains_and_an_over_long_one_gets_its_400(pg_stack, sample):
    """Kimi Linear has no position limit: with no max_seq_len its bound is the longest example (here
    ~6,000 tokens, trained whole on the CPU); a max_seq_len under it names the line and the fix; a
    model with a position limit names its limit; a max_seq_len over that limit is a 400 too."""
    short = [l for l in (sample / "train.jsonl").read_text().splitlines() if '"images"' not in l][:7]
    text = "\n".join([json.dumps(long_document(6000)), *short]).encode()
    with pg_stack.client() as c:
        f = c.post("/v1/files", files={"file": ("long.jsonl", text)}, data={"purpose": "fine-tune"}).json()
        rep = c.get(f"/v1/files/{f['id']}/report", params={"model": "kimi-linear-tiny"}).json()
        assert rep["ok"] and rep["max_seq_len"] is None and rep["position_limit"] is None
        longest = rep["stats"]["max_example_tokens"]
        assert longest > 4096

        r = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kimi-linear-tiny", "training_file": f["id"], "hyperparameters": {"max_seq_len": 4096}},
        )
        assert r.status_code == 400
        assert (
            f"line 1: messages: example is {longest} tokens, over max_seq_len 4096; raise "
            f"hyperparameters.max_seq_len to {longest} or more (kimi-linear-tiny has no position limit)"
            in r.json()["error"]["message"]
        )
        r = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"]})
        assert r.status_code == 400
        assert (
            f"example is {longest} tokens, over max_seq_len 2048; shorten it: kiln-tiny takes at most 2048"
            in r.json()["error"]["message"]
        )
        r = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", "training_file": f["id"], "hyperparameters": {"max_seq_len": 8192}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.max_seq_len"
        assert "max_seq_len 8192 is over kiln-tiny's position limit of 2048 tokens" in r.json()["error"]["message"]

        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kimi-linear-tiny",
                "training_file": f["id"],
                "seed": 3,
                "hyperparameters": {"n_epochs": 1, "batch_size": 2},
            },
        ).json()
        done = finished(c, job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        events = all_events(c, job["id"])
        metrics = [e["data"] for e in events if e["type"] == "metrics"]
        assert any(f"packed into rows of {longest} tokens" in e["message"] for e in events)
        assert len(metrics) == 4  # 8 examples, 2 a step
        assert max(m["trained_tokens"] for m in metrics) == rep["stats"]["tokens"]  # every token, the long one whole

        # context parallel through the service: two ranks share each sequence; the same steps
        r = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kiln-tiny",
                "training_file": short_file(c, short),
                "hyperparameters": {"parallel": {"nproc": 2, "cp_size": 2}},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "hyperparameters.parallel.cp_size"
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": "kimi-linear-tiny",
                "training_file": f["id"],
                "seed": 3,
                "hyperparameters": {"n_epochs": 1, "batch_size": 2, "parallel": {"nproc": 2, "cp_size": 2}},
            },
        ).json()
        done = finished(c, job["id"], timeout=300)
        assert done["status"] == "succeeded", done["error"]
        events = all_events(c, job["id"])
        split = [e["data"] for e in events if e["type"] == "metrics"]
        assert any("each sequence split 2 ways (context parallel)" in e["message"] for e in events)
    by_step = {m["step"]: m for m in metrics}
    for m in split:
        assert m["train_loss"] == pytest.approx(by_step[m["step"]]["train_loss"], rel=1e-4)
        assert m["trained_tokens"] == by_step[m["step"]]["trained_tokens"]
