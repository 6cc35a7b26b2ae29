"""Chat completions through the official openai SDK against the real stack: PostgreSQL, Redis,
the API under uvicorn, a Celery worker that trains the fine-tunes, and the inference server
(``python -m workers.inference``), each its own process."""

from __future__ import annotations

import base64
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from kiln import Client, cli
from kiln.dataset import Example, Message
from kiln.errors import BadRequestError, NotFoundError
from kiln.tokenizer import ByteTokenizer, chat_template, encode_chat
from kiln.types import Usage
from tests.conftest import finished, wait_for

QUESTION = [{"role": "user", "content": "What is 11 + 7?"}]


@pytest.fixture(scope="module")
def stack(make_pg_stack):
    return make_pg_stack()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def served(stack):
    """The inference server, up."""
    stack.start_inference()
    return stack


def train(stack, model: str, lines: bytes, **hyperparameters) -> str:
    """A short fine-tune of alice's; its fine-tuned model's name."""
    with stack.client() as c:
        f = c.post("/v1/files", files={"file": ("t.jsonl", lines)}, data={"purpose": "fine-tune"}).json()
        body = {"model": model, "training_file": f["id"], "seed": 3, "hyperparameters": hyperparameters}
        job = c.post("/v1/fine_tuning/jobs", json=body).json()
        done = finished(c, job["id"], timeout=300)
    assert done["status"] == "succeeded", done["error"]
    return done["fine_tuned_model"]


def text_only(sample) -> bytes:
    return "\n".join(l for l in (sample / "train.jsonl").read_text().splitlines() if '"images"' not in l).encode()


@pytest.fixture(scope="module")
def tiny_ft(stack, sample):
    return train(stack, "kiln-tiny", text_only(sample), batch_size=8, max_steps=40, learning_rate_multiplier=1)


@pytest.fixture(scope="module")
def kimi_ft(stack, sample):
    return train(stack, "kimi-linear-tiny", text_only(sample), batch_size=8, max_steps=6)


def image_url(sample) -> str:
    with zipfile.ZipFile(sample / "images.zip") as zf:
        png = next(zf.read(n) for n in zf.namelist() if n.endswith(".png"))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def ask(oai, model: str, **kw):
    return oai.chat.completions.create(model=model, messages=kw.pop("messages", QUESTION), **kw)


def bad(oai, error: type[openai.APIStatusError], **kw) -> str:
    """The message of the error a request gets."""
    with pytest.raises(error) as e:
        ask(oai, kw.pop("model", "kiln-tiny"), **kw)
    return e.value.body["message"]  # type: ignore[index]


# ---- without the inference server ----------------------------------------------------------------
def test_without_the_inference_server_a_valid_request_is_a_503(stack, oai):
    stack.stop_inference()
    with pytest.raises(openai.InternalServerError) as e:
        ask(oai, "kiln-tiny", max_tokens=4)
    assert e.value.status_code == 503
    assert f"The inference server at {stack.inference_url} is not reachable" in e.value.message
    assert "python -m workers.inference" in e.value.message


def test_bad_requests_are_400s_naming_the_field(oai, sample):
    B = openai.BadRequestError
    assert "messages: List should have at least 1 item" in bad(oai, B, messages=[])
    ends = bad(oai, B, messages=[*QUESTION, {"role": "assistant", "content": "18"}])
    assert ends.startswith("messages[1].role: the last message is the assistant's")
    assert bad(oai, B, n=9) == "n: Input should be less than or equal to 8"
    assert bad(oai, B, max_tokens=4, max_completion_tokens=5) == (
        "max_tokens (4) and max_completion_tokens (5) differ; give one of them"
    )
    assert bad(oai, B, max_tokens=2048).startswith(
        "max_tokens: 2048 leaves no room for the prompt in kiln-tiny's position limit of 2048 tokens"
    )
    assert bad(oai, B, temperature=2.5) == "temperature: Input should be less than or equal to 2"
    assert bad(oai, B, top_p=0) == "top_p: Input should be greater than 0"
    five = ["a", "b", "c", "d", "e"]
    assert bad(oai, B, stop=five) == "stop: List should have at most 4 items after validation, not 5"
    assert bad(oai, B, stop="") == "stop: String should have at least 1 character"
    assert bad(oai, B, logprobs=True).startswith("logprobs: not supported")
    assert bad(oai, B, stream_options={"include_usage": True}) == "stream_options: only with stream true"
    assert bad(oai, B, extra_body={"temprature": 1}) == "temprature: unknown field; did you mean 'temperature'?"
    assert bad(oai, B, messages=[{"role": "bot", "content": "hi"}]) == (
        "messages[0].role: Input should be 'system', 'user' or 'assistant'"
    )
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]
    assert bad(oai, B, messages=remote).startswith("messages[0].content[0].image_url.url: must be a data: URL")
    hello = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}
    ]
    assert bad(oai, B, messages=hello).startswith("messages[0].content[0].image_url.url: unreadable image: ")
    placeholder = [{"role": "user", "content": "<image> what is it?"}]
    assert "1 <image> placeholder(s) but 0 image(s)" in bad(oai, B, messages=placeholder)
    picture = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(sample)}}]}]
    assert bad(oai, B, model="kimi-linear-tiny", messages=picture).startswith(
        "messages[0].content[0]: kimi-linear-tiny takes no image input (a text-only model); models that do: "
        "kiln-tiny, kiln-hybrid-tiny"
    )
    assert bad(oai, B, model="gpt-4o") == (
        "model: 'gpt-4o' is not a model; models: kiln-tiny, kimi-linear-tiny, kiln-hybrid-tiny, and your "
        "fine-tuned models (ft:..., as GET /v1/models lists them) and their checkpoints"
    )


def test_unknown_and_unfinished_fine_tunes(stack, oai, sample):
    missing = "ft:kiln-tiny:alice::nope"
    assert bad(oai, openai.NotFoundError, model=missing) == f"No model found with id {missing!r}"
    assert bad(oai, openai.NotFoundError, model="ftckpt_nope") == "No model found with id 'ftckpt_nope'"
    with stack.client() as c:
        f = c.post("/v1/files", files={"file": ("t.jsonl", text_only(sample))}, data={"purpose": "fine-tune"}).json()
        job = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", "training_file": f["id"]}).json()
        c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
        wait_for(lambda: c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "cancelled", what="cancel")
    name = f"ft:kiln-tiny:alice::{job['id']}"  # the name its checkpoints carry until it succeeds
    assert bad(oai, openai.ConflictError, model=name) == (
        f"model: {name} is the model of job {job['id']}, which is cancelled: it answers once the job has "
        "succeeded (its checkpoints, ...:ckpt-step-N, answer as soon as they are saved)"
    )


# ---- with the inference server -------------------------------------------------------------------
def prompt_tokens(messages: list[dict]) -> int:
    """kiln-tiny's prompt length: its byte tokenizer's chat, then the assistant's header."""
    tok = ByteTokenizer()
    tpl = chat_template(tok)
    ids, _ = encode_chat(tok, tpl, Example(0, [Message(m["role"], m["content"]) for m in messages], []), 0)
    return len(ids) + len(tpl.start["assistant"])


def test_a_base_model_answers(served, oai):
    r = ask(oai, "kiln-tiny", max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "kiln-tiny"
    assert abs(r.created - time.time()) < 60
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == prompt_tokens(QUESTION)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_a_stream_says_what_the_answer_says(served, oai):
    whole = ask(oai, "kiln-tiny", max_tokens=12, temperature=0)
    usage = {"include_usage": True}
    chunks = list(ask(oai, "kiln-tiny", max_tokens=12, temperature=0, stream=True, stream_options=usage))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_n_seed_and_stop(served, oai):
    two = ask(oai, "kiln-tiny", n=2, max_tokens=16, seed=11)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    again = ask(oai, "kiln-tiny", n=2, max_tokens=16, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    other = ask(oai, "kiln-tiny", n=2, max_tokens=16, seed=12)
    assert [c.message.content for c in other.choices] != [c.message.content for c in two.choices]
    # a stop string: the greedy answer up to its first occurrence, which is left out
    full = ask(oai, "kiln-tiny", max_tokens=24, temperature=0).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2
    cut = ask(oai, "kiln-tiny", max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_a_prompt_over_the_position_limit_is_the_servers_400(served, oai):
    n = prompt_tokens(QUESTION)
    assert bad(oai, openai.BadRequestError, max_tokens=2040) == (
        f"max_tokens: the prompt is {n} tokens and max_tokens 2040, over kiln-tiny's position limit of 2048 "
        f"tokens (prompt and answer together); ask for at most {2048 - n}"
    )
    long = [{"role": "user", "content": "x" * 2100}]
    assert bad(oai, openai.BadRequestError, messages=long).startswith(
        f"messages: the prompt is {prompt_tokens(long)} tokens; kiln-tiny takes at most 2048 tokens"
    )


def test_fine_tuned_kiln_tiny_answers_with_its_adapter(served, oai, tiny_ft, sample):
    base = ask(oai, "kiln-tiny", max_tokens=8, temperature=0).choices[0]
    tuned = ask(oai, tiny_ft, max_tokens=8, temperature=0).choices[0]
    assert tuned.message.content != base.message.content  # the adapter changes the answer
    assert tuned.finish_reason == "stop" and tuned.message.content.strip().isdigit(), tuned.message.content
    stream = ask(oai, tiny_ft, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed == tuned.message.content
    job = oai.fine_tuning.jobs.list().data[0]
    last = oai.fine_tuning.jobs.checkpoints.list(job.id).data[0]  # the final adapter is its last checkpoint's
    for name in (last.fine_tuned_model_checkpoint, last.id):
        assert ask(oai, name, max_tokens=8, temperature=0).choices[0].message.content == tuned.message.content
    parts = [{"type": "image_url", "image_url": {"url": image_url(sample)}}, {"type": "text", "text": "How many?"}]
    picture = [{"role": "user", "content": parts}]
    seen = ask(oai, tiny_ft, messages=picture, max_tokens=4, temperature=0)
    assert seen.usage.prompt_tokens == prompt_tokens([{"role": "user", "content": "How many?"}]) + 16  # 16 image tokens


def test_fine_tuned_kimi_linear_tiny_answers(served, stack, oai, kimi_ft, capsys):
    base = ask(oai, "kimi-linear-tiny", max_tokens=6, temperature=0).choices[0]
    tuned = ask(oai, kimi_ft, max_tokens=6, temperature=0)
    assert tuned.choices[0].message.content != base.message.content
    chunks = list(ask(oai, kimi_ft, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tuned.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == tuned.choices[0].finish_reason
    # Kiln's own SDK: the same answer, whole and streamed (with the usage), and its errors
    with Client(stack.base_url, api_key=stack.keys["alice"], max_retries=0) as kiln:
        ours = kiln.chat.completions.create(kimi_ft, QUESTION, max_tokens=6, temperature=0)
        assert ours.choices[0].message.content == tuned.choices[0].message.content
        theirs = tuned.usage
        assert ours.usage == Usage(
            prompt_tokens=theirs.prompt_tokens,
            completion_tokens=theirs.completion_tokens,
            total_tokens=theirs.total_tokens,
        )
        pieces = list(
            kiln.chat.completions.stream(
                kimi_ft, QUESTION, max_tokens=6, temperature=0, stream_options={"include_usage": True}
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == ours.choices[0].message.content
        assert pieces[-1].usage == ours.usage
        with pytest.raises(NotFoundError, match="No model found with id 'ft:nope'"):
            kiln.chat.completions.create("ft:nope", QUESTION)
        with pytest.raises(BadRequestError, match="n: "):
            kiln.chat.completions.create(kimi_ft, QUESTION, n=9)
    # and the command line's
    capsys.readouterr()
    key = ["--base-url", stack.base_url, "--api-key", stack.keys["alice"]]
    assert cli.run([*key, "chat", kimi_ft, QUESTION[0]["content"], "--max-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tuned.choices[0].message.content + "\n"


def test_another_owners_fine_tune_is_not_found(served, stack, tiny_ft):
    bob = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.keys["bob"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        ask(bob, tiny_ft, max_tokens=2)
    assert e.value.body["message"] == f"No model found with id {tiny_ft!r}"  # type: ignore[index]


def test_a_client_that_hangs_up_cancels_its_answer(served, stack, oai):
    def open_answers() -> int:
        return httpx.get(f"{stack.inference_url}/healthz").json()["open"]

    # 8 choices of 2000 tokens, about 8 s of decoding on this CPU: kiln-tiny's greedy answer here
    # is a loop without its end token (a random model's drawn answers end within a few hundred
    # tokens, 1-2 s; kimi-linear-tiny's greedy one after 61); a cancel is seen within 4 s
    long = {"model": "kiln-tiny", "messages": QUESTION, "max_tokens": 2000, "n": 8, "temperature": 0}
    stream = oai.chat.completions.create(**long, stream=True)
    next(iter(stream))
    assert open_answers() == 1
    stream.close()
    wait_for(lambda: open_answers() == 0, timeout=4, what="the stream's answer to be cancelled")
    with stack.client(timeout=3) as c, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.post, "/v1/chat/completions", json=long)  # not streamed: waits, then gives up
        wait_for(lambda: open_answers() == 1, timeout=3, interval=0.05, what="the answer to start")
        with pytest.raises(httpx.ReadTimeout):
            waiting.result()
    wait_for(lambda: open_answers() == 0, timeout=4, what="the hung-up request's answer to be cancelled")
    # their 8 slots each are free again: a short answer does not wait behind 2 x 8 x 2000 tokens
    quick = ask(oai, "kiln-tiny", max_tokens=4, temperature=0, timeout=20)
    assert quick.usage is not None and quick.usage.completion_tokens <= 4
