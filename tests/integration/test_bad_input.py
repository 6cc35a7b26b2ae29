"""Every bad input gets a 4xx in OpenAI's error shape that names the problem, and leaves
nothing behind in the store or the database."""

from __future__ import annotations

import io
import json
import zipfile

import openai
import pytest

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def jsonl(*rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode() + b"\n"


def stored_objects(stack) -> list[str]:
    return sorted(p.name for p in (stack.store / "objects").rglob("*") if p.is_file())


def leftovers(stack) -> list[str]:
    return [p.name for p in (stack.store / "tmp").iterdir()]


def upload(c, name: str, content: bytes, purpose: str = "fine-tune"):
    return c.post("/v1/files", files={"file": (name, content)}, data={"purpose": purpose})


def assert_error(r, status: int, *needles: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    for n in needles:
        assert n in err["message"], (n, err["message"])
    if param:
        assert err["param"] == param
    assert {"message", "type", "param", "code"} <= set(err)
    assert r.headers["x-should-retry"] == "false"
    return err


@pytest.mark.parametrize(
    "rows, needles",
    [
        ((GOOD, "{not json"), ["line 2", "invalid JSON"]),
        (
            ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},),
            ["line 1", "messages[0].role", "unknown role 'bot'"],
        ),
        (
            (GOOD, GOOD, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}),
            ["line 3", "messages[1].content", "empty assistant turn"],
        ),
        (
            (
                {
                    "images": ["a.png", "b.png"],
                    "messages": [{"role": "user", "content": "<image> q"}, {"role": "assistant", "content": "1"}],
                },
            ),
            ["line 1", "images", "1 <image> placeholder(s) but 2 image(s)"],
        ),
        (
            (
                {
                    "images": ["../../etc/passwd"],
                    "messages": [{"role": "user", "content": "<image> q"}, {"role": "assistant", "content": "1"}],
                },
            ),
            ["line 1", "images[0]", "escapes the dataset root"],
        ),
        (({"messages": "hello"},), ["line 1", "messages", "non-empty list"]),
        (({"messages": [{"role": "user", "content": "only a question"}]},), ["line 1", "no assistant message"]),
        (
            (
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                        {"role": "assistant", "content": "a"},
                    ]
                },
            ),
            ["line 1", "images[0]", "remote image URLs"],
        ),
        (("[1, 2]",), ["line 1", "JSON object"]),
    ],
)
def test_bad_dataset_lines_name_line_and_field(pg_stack, rows, needles):
    before = stored_objects(pg_stack)
    with pg_stack.client() as c:
        err = assert_error(upload(c, "bad.jsonl", jsonl(*rows)), 400, *needles, param="file")
        line = int(needles[0].split()[1])
        assert err["issues"] and all(i["line"] == line for i in err["issues"])
        assert not [f for f in c.get("/v1/files").json()["data"] if f["filename"] == "bad.jsonl"]
    assert stored_objects(pg_stack) == before and leftovers(pg_stack) == []


def test_oversize_upload_is_refused_and_nothing_kept(pg_stack):
    before = stored_objects(pg_stack)
    big = jsonl(*[GOOD] * 40000)  # about 3 MB; the test server allows 2 MB
    with pg_stack.client() as c:
        assert_error(upload(c, "big.jsonl", big), 413, "upload limit of 2000000 bytes", param="file")

        def chunks():  # no Content-Length: the limit has to stop the stream itself
            for i in range(0, len(big), 65536):
                yield big[i : i + 65536]

        boundary = "kilnboundary"
        body = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'.encode(),
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'.encode(),
        ]

        def stream():
            yield from body
            yield from chunks()
            yield f"\r\n--{boundary}--\r\n".encode()

        r = c.post("/v1/files", content=stream(), headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert_error(r, 413, "upload limit", param="file")
    assert stored_objects(pg_stack) == before and leftovers(pg_stack) == []


def test_wrong_or_missing_key(pg_stack):
    import httpx

    r = httpx.get(f"{pg_stack.base_url}/v1/files", headers={"Authorization": "Bearer sk-kiln-nope"})
    assert_error(r, 401, "Incorrect API key")
    r = httpx.get(f"{pg_stack.base_url}/v1/fine_tuning/jobs")
    assert_error(r, 401, "Missing API key")
    client = openai.OpenAI(base_url=f"{pg_stack.base_url}/v1", api_key="sk-kiln-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.fine_tuning.jobs.list()


def test_revoked_key_stops_working(pg_stack):
    secret = pg_stack.admin("create-key", "--owner", "carol")
    import httpx

    assert httpx.get(f"{pg_stack.base_url}/v1/files", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    key_id = [line.split("\t")[0] for line in pg_stack.admin("list-keys").splitlines() if "\tcarol\t" in line][0]
    pg_stack.admin("revoke-key", key_id)
    assert httpx.get(f"{pg_stack.base_url}/v1/files", headers={"Authorization": f"Bearer {secret}"}).status_code == 401


@pytest.fixture(scope="module")
def text_file(pg_stack):
    with pg_stack.client() as c:
        return upload(c, "good.jsonl", jsonl(GOOD, GOOD)).json()["id"]


@pytest.mark.parametrize(
    "patch, status, needles, param",
    [
        ({"hyperparameters": {"n_epochs": 0}}, 400, ["hyperparameters.n_epochs"], "hyperparameters.n_epochs"),
        ({"hyperparameters": {"n_epochs": "many"}}, 400, ["n_epochs"], None),
        ({"hyperparameters": {"learning_rate_multiplier": -1}}, 400, ["learning_rate_multiplier"], None),
        ({"hyperparameters": {"batch_size": 1000}}, 400, ["batch_size"], None),
        ({"hyperparameters": {"n_epoch": 3}}, 400, ["n_epoch: unknown field; did you mean 'n_epochs'?"], None),
        ({"lora": {"rank": 0}}, 400, ["lora.rank"], None),
        ({"hyperparameters": {"memory": {"tier": "disk"}}}, 400, ["hyperparameters.memory.tier"], None),
        ({"hyperparameters": {"memory": {"cache_ops": ["conv"]}}}, 400, ["memory.cache_ops"], None),
        ({"hyperparameters": {"memory": {"blocks": ["ffn"]}}}, 400, ["hyperparameters.memory.blocks"], None),
        (
            {"hyperparameters": {"parallel": {"nproc": 4, "ep_size": 3}}},
            400,
            ["ep_size (3) must divide nproc (4)"],
            None,
        ),
        ({"hyperparameters": {"parallel": {"nproc": 0}}}, 400, ["hyperparameters.parallel.nproc"], None),
        (
            {"hyperparameters": {"parallel": {"nproc": 2, "ep_size": 2}}},
            400,
            ["does not divide the 0 experts of kiln-tiny"],
            "hyperparameters.parallel.ep_size",
        ),
        ({"metadata": {"note": "a\u0000b"}}, 400, ["metadata", "must not contain NUL characters"], None),
        ({"lora": {"target_modules": ["qkv"]}}, 400, ["unknown name(s) qkv"], "lora.target_modules"),
        (
            {"lora": {"target_parameters": ["mlp.experts.gate_up_proj"]}},
            400,
            ["choose from none"],
            "lora.target_parameters",
        ),
        ({"model": "gpt-5"}, 400, ["'gpt-5' is not available", "kiln-tiny"], "model"),
        ({"training_file": "file-doesnotexist"}, 404, ["No file found with id 'file-doesnotexist'"], "training_file"),
        ({"suffix": "bad suffix!"}, 400, ["suffix"], "suffix"),
        (  # one setting in both places, two values: a 400 naming both, not one silently winning
            {
                "hyperparameters": {"n_epochs": 2, "batch_size": 4},
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3, "batch_size": 4}}},
            },
            400,
            ["hyperparameters.n_epochs (2) and method.supervised.hyperparameters.n_epochs (3) differ"],
            "hyperparameters.n_epochs",
        ),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, ["metadata", "at most 16 keys, got 17"], "metadata"),
        ({"metadata": {"k" * 65: "v"}}, 400, ["metadata", "65 characters; at most 64"], "metadata"),
        ({"metadata": {"k": "v" * 513}}, 400, ["metadata", "513 characters; at most 512"], "metadata"),
        ({"lora": {"rnak": 4}}, 400, ["lora.rnak: unknown field; did you mean 'rank'?"], "lora.rnak"),
        ({"hyperparameters": {"batch_size": "x"}}, 400, ["hyperparameters.batch_size: Input should be 'auto'"], None),
        (  # the tracking server is the operator's: this stack has none
            {"integrations": [{"type": "mlflow", "mlflow": {}}]},
            400,
            ["no MLflow tracking server configured"],
            "integrations",
        ),
        ({"integrations": [{"type": "comet", "comet": {}}]}, 400, ["integrations[0]"], None),
        (
            {"integrations": [{"type": "wandb", "wandb": {}}]},
            400,
            ["integrations[0].wandb.project: Field required"],
            None,
        ),
    ],
)
def test_bad_job_requests(pg_stack, text_file, patch, status, needles, param):
    body = {"model": "kiln-tiny", "training_file": text_file, **patch}
    with pg_stack.client() as c:
        before = c.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"]
        err = assert_error(c.post("/v1/fine_tuning/jobs", json=body), status, *needles, param=param)
        assert "constrained" not in err["message"]  # no pydantic-internal names
        assert c.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"] == before


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"name": "\\udb69\\udcdf9\\u0000"}', "must not contain NUL characters"),
        (b'{"name": "\\udb69x"}', "valid string"),
    ],
)
def test_key_names_the_database_cannot_keep_are_a_400(pg_stack, raw, needle):
    """Found by the API fuzzer: a name with NUL was a 500 from PostgreSQL."""
    with pg_stack.client() as c:
        before = c.get("/v1/keys").json()["data"]
        r = c.post("/v1/keys", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, "name", needle)
        assert c.get("/v1/keys").json()["data"] == before


def test_missing_image_names_line_and_field(pg_stack, sample):
    rows = [
        GOOD,
        {
            "images": ["images/nope.png"],
            "messages": [{"role": "user", "content": "<image>\nq"}, {"role": "assistant", "content": "a"}],
        },
    ]
    with pg_stack.client() as c:
        f = upload(c, "imgs.jsonl", jsonl(*rows)).json()
        images = upload(c, "images.zip", (sample / "images.zip").read_bytes()).json()
        r = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"]})
        assert_error(r, 400, "line 2", "images[0]", "upload the images as a zip", param="training_file")
        r = c.post(
            "/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"], "images_file": images["id"]}
        )
        assert_error(r, 400, "line 2", "images[0]", "'images/nope.png' not found in the uploaded archive")


def test_unreadable_image_in_archive(pg_stack):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(
            "data/train.jsonl",
            jsonl(
                {
                    "images": ["img/x.png"],
                    "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "a"}],
                }
            ),
        )
        zf.writestr("data/img/x.png", b"this is not a png")
    with pg_stack.client() as c:
        assert_error(upload(c, "ds.zip", buf.getvalue()), 400, "line 1", "images[0]", "unreadable image")


def test_archive_member_escaping_root(pg_stack):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../evil.png", b"x")
    with pg_stack.client() as c:
        assert_error(upload(c, "evil.zip", buf.getvalue()), 400, "escapes the archive root")


def test_bad_purpose_and_form(pg_stack):
    with pg_stack.client() as c:
        assert_error(
            upload(c, "good.jsonl", jsonl(GOOD), purpose="batch"), 400, "purpose must be one of", param="purpose"
        )
        assert_error(c.post("/v1/files", files={"purpose": (None, "fine-tune")}), 400, "Missing the 'file' part")
        assert_error(c.post("/v1/files", data={"purpose": "fine-tune"}), 415, "multipart/form-data")
        assert_error(c.post("/v1/files", json={"purpose": "fine-tune"}), 415, "multipart/form-data")
        assert_error(upload(c, "notes.pdf", b"%PDF-1.4"), 400, "Unsupported file type")
    assert leftovers(pg_stack) == []


def test_cancel_finished_job_is_a_conflict(pg_stack, text_file):
    from tests.conftest import wait_for

    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", "training_file": text_file, "hyperparameters": {"n_epochs": 1}},
        ).json()
        wait_for(lambda: c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "succeeded", what="job")
        assert_error(c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel"), 409, "already succeeded")
        assert_error(c.get("/v1/fine_tuning/jobs", params={"limit": 0}), 400, "limit")
        assert_error(c.get("/v1/fine_tuning/jobs", params={"after": "ftjob-nope"}), 404, "No object found")
        assert_error(c.get("/v1/fine_tuning/jobs/ftjob-nope"), 404, "No fine-tuning job")
