"""The monitoring page's playground in real headless Chromium against the real stack (PostgreSQL,
Redis, the API, a Celery worker, the inference server): a short fine-tune of kiln-tiny and its
base answer the same message side by side, streamed token by token; each side's next request
carries its own earlier answer; Stop ends both streams; the API's errors are shown in the panel.

kiln-tiny's answers are random text, so no answer's content is asserted: at temperature 0 its
base answers with one repeated character and never ends its turn (measured: 2000 tokens in
about 27 s on the 2-core VM), which gives Stop time to act."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from tests.conftest import finished, wait_for
from tests.integration.test_web import CHROMIUM, FLAGS, PHONE, sign_in, wait_for_text

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
CHAT = "/v1/chat/completions"
FIRST, SECOND = "What is 11 + 7?", "And 2 + 2?"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, pg_stack):
    ctx, pg, errors = sign_in(browser, pg_stack, {"width": 1100, "height": 1000})
    yield pg
    ctx.close()
    assert errors == []


@pytest.fixture(scope="module")
def tuned(pg_stack, sample) -> dict:
    """A succeeded fine-tune of kiln-tiny on the sample's text-only lines: 2 steps at a small
    learning rate, so that at temperature 0 it answers at length like its base (at the default
    rate 4 steps teach it to end its turn at once: an empty answer, which shows nothing streamed)."""
    lines = [line for line in (sample / "train.jsonl").read_text().splitlines() if '"images"' not in line]
    with pg_stack.client() as c:
        f = c.post("/v1/files", files={"file": ("t.jsonl", "\n".join(lines))}, data={"purpose": "fine-tune"})
        body = {
            "model": "kiln-tiny",
            "training_file": f.json()["id"],
            "hyperparameters": {"max_steps": 2, "learning_rate_multiplier": 0.01},
        }
        job = finished(c, c.post("/v1/fine_tuning/jobs", json=body).json()["id"], timeout=300)
    assert job["status"] == "succeeded", job["error"]
    return job


@pytest.fixture(scope="module")
def served(pg_stack):
    pg_stack.start_inference()
    return pg_stack


def chat_requests(page) -> list[dict]:
    """The bodies of the chat requests the page sends from now on, in order."""
    sent: list[dict] = []

    def record(r) -> None:
        if r.url.endswith(CHAT) and r.method == "POST":
            sent.append(r.post_data_json)

    page.on("request", record)
    return sent


def open_playground(page, pg_stack, settings: dict[str, str]) -> None:
    page.click("nav a[href='#/playground']")
    page.wait_for_selector("#playground:not([hidden]) #play-model option", state="attached")
    for field, text in settings.items():
        page.fill(f"#play-{field}", text)


def send(page, text: str) -> None:
    page.fill("#play-message", text)
    page.click("#play-send")


def answers(page, side: str) -> list[str]:
    return page.locator(f"#play-{side}-chat .turn.assistant").all_text_contents()


def wait_until_answered(page, turns: int) -> None:
    """Until each side shows `turns` answers, all ended, and Send is back."""
    page.wait_for_function(
        """n => ['base', 'tuned'].every(s => {
          const said = document.querySelectorAll(`#play-${s}-chat .turn.assistant[data-finish]`);
          return said.length === n && !document.querySelector(`#play-${s}-chat .streaming`);
        }) && !document.getElementById('play-send').disabled""",
        arg=turns,
        timeout=120_000,
    )


# Lengths of each side's answer while it streams, read by a MutationObserver at every change.
RECORD_STREAMING = """() => {
  window.seen = {base: [], tuned: []};
  for (const side of ['base', 'tuned']) {
    const chat = document.getElementById(`play-${side}-chat`);
    new MutationObserver(() => {
      const said = chat.querySelector('.turn.assistant.streaming');
      if (said) window.seen[side].push(said.textContent.length);
    }).observe(chat, {subtree: true, childList: true, characterData: true});
  }
}"""


def test_base_and_fine_tune_answer_side_by_side_streamed(page, pg_stack, tuned, served):
    ft = tuned["fine_tuned_model"]
    # The job page leads to the playground with its fine-tuned model chosen, beside its base.
    page.goto(f"{pg_stack.base_url}/ui/#/jobs/{tuned['id']}")
    page.wait_for_function("document.getElementById('job-status').textContent === 'succeeded'")
    page.click("#job-play")
    page.wait_for_selector("#playground:not([hidden])")
    assert page.evaluate("location.hash") == f"#/playground/{quote(ft, safe='')}"
    wait_for_text(page, "#play-tuned-model", ft)
    assert page.input_value("#play-model") == ft
    assert page.text_content("#play-base-model") == "kiln-tiny"  # the fine-tune's root
    assert page.is_hidden("#play-none")
    sent = chat_requests(page)
    page.fill("#play-temperature", "0")
    page.fill("#play-max_tokens", "24")
    page.evaluate(RECORD_STREAMING)
    send(page, FIRST)
    wait_until_answered(page, 1)
    # One request to each model, the same message and settings, streamed.
    assert sorted(r["model"] for r in sent) == sorted([ft, "kiln-tiny"])
    asked = {"messages": [{"role": "user", "content": FIRST}], "stream": True, "temperature": 0, "max_tokens": 24}
    assert all(r == {"model": r["model"], **asked} for r in sent), sent
    seen = page.evaluate("window.seen")
    first: dict[str, str] = {}
    for side in ("base", "tuned"):
        [first[side]] = answers(page, side)
        assert first[side], side
        said = page.locator(f"#play-{side}-chat .turn.assistant")
        assert int(said.get_attribute("data-chunks")) >= 2, side
        assert said.get_attribute("data-finish") in ("length", "stop")
        # Token by token: the column showed part of the answer before all of it.
        assert any(0 < n < len(first[side]) for n in seen[side]), (side, seen[side])
        assert page.locator(f"#play-{side}-chat .turn.user").all_text_contents() == [FIRST]
        assert page.text_content(f"#play-{side}-error") == ""
    assert page.input_value("#play-message") == ""
    # Columns side by side on a wide screen.
    base_box = page.locator("#play-base").bounding_box()
    tuned_box = page.locator("#play-tuned").bounding_box()
    assert base_box and tuned_box and base_box["y"] == tuned_box["y"] and base_box["x"] < tuned_box["x"]

    # Multi-turn: each side's second request carries its own first answer.
    del sent[:]
    send(page, SECOND)
    wait_until_answered(page, 2)
    assert len(sent) == 2
    answer_of = {"kiln-tiny": first["base"], ft: first["tuned"]}
    for r in sent:
        assert r["messages"] == [
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": answer_of[r["model"]]},
            {"role": "user", "content": SECOND},
        ]
    for side in ("base", "tuned"):
        assert page.locator(f"#play-{side}-chat .turn.user").all_text_contents() == [FIRST, SECOND]
        assert answers(page, side)[0] == first[side] and answers(page, side)[1]

    # A new conversation starts empty: the next request carries only its own message.
    page.click("#play-clear")
    assert page.locator("#play-base-chat .turn, #play-tuned-chat .turn").count() == 0
    del sent[:]
    send(page, FIRST)
    wait_until_answered(page, 1)
    assert [r["messages"] for r in sent] == [[{"role": "user", "content": FIRST}]] * 2


def open_answers(pg_stack) -> int:
    return httpx.get(f"{pg_stack.inference_url}/healthz").json()["open"]


BOTH_STREAMING = """() => ['base', 'tuned'].every(s =>
  (document.querySelector(`#play-${s}-chat .turn.assistant.streaming`)?.textContent || '').length > 0)"""


def test_stop_ends_both_streams(page, pg_stack, tuned, served):
    open_playground(page, pg_stack, {"temperature": "0", "max_tokens": "2000"})
    send(page, FIRST)
    page.wait_for_function(BOTH_STREAMING, timeout=60_000)
    assert page.is_disabled("#play-send") and page.is_enabled("#play-stop")
    assert page.is_disabled("#play-model")  # no other model while these answers stream
    page.click("#play-stop")
    wait_until_answered(page, 1)
    for side in ("base", "tuned"):
        said = page.locator(f"#play-{side}-chat .turn.assistant")
        assert said.get_attribute("data-finish") == "stopped", side
        assert 0 < len(said.text_content()) < 2000
    assert page.is_disabled("#play-stop")
    # The page hung up, and the inference server stopped generating both answers.
    wait_for(lambda: open_answers(pg_stack) == 0, timeout=10, what="both answers to be cancelled")
    # A stopped answer stays in its side's conversation.
    sent = chat_requests(page)
    page.fill("#play-max_tokens", "4")
    send(page, SECOND)
    wait_until_answered(page, 2)
    for r in sent:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user"]
        assert r["messages"][1]["content"]


def test_the_apis_errors_are_shown_in_the_panel(page, pg_stack, tuned, served):
    open_playground(page, pg_stack, {"temperature": "0", "max_tokens": "99999"})
    # A setting the API refuses: its 400's message in each column, and nothing joins either side's
    # conversation; the message goes back into the box to be sent again.
    with page.expect_response(lambda r: r.url.endswith(CHAT)) as res:
        send(page, FIRST)
    assert res.value.status == 400
    message = res.value.json()["error"]["message"]
    assert message.startswith("max_tokens: ")
    for side in ("base", "tuned"):
        wait_for_text(page, f"#play-{side}-error", message)
        assert page.locator(f"#play-{side}-chat .turn").count() == 0
    page.wait_for_function("!document.getElementById('play-send').disabled")
    assert page.input_value("#play-message") == FIRST

    # Without the inference server: the API's 503 says which server it could not reach.
    page.fill("#play-max_tokens", "8")
    pg_stack.stop_inference()
    with page.expect_response(lambda r: r.url.endswith(CHAT)) as res:
        page.click("#play-send")
    assert res.value.status == 503
    message = res.value.json()["error"]["message"]
    assert f"The inference server at {pg_stack.inference_url} is not reachable" in message
    for side in ("base", "tuned"):
        wait_for_text(page, f"#play-{side}-error", message)

    # A model in the address that is not among the caller's fine-tunes is named; the newest is chosen.
    page.goto(f"{pg_stack.base_url}/ui/#/playground/{quote('ft:kiln-tiny:alice::nope', safe='')}")
    wait_for_text(page, "#play-error", "ft:kiln-tiny:alice::nope is not one of your fine-tuned models")
    assert page.input_value("#play-model") == tuned["fine_tuned_model"]


def test_without_a_fine_tune_on_a_phone(browser, pg_stack, tuned):
    """Bob has no fine-tune (alice's is not his): the panel says so, Send asks for a model and
    sends nothing; the columns fit a phone's 390 px, one above the other."""
    ctx = browser.new_context(viewport=PHONE)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        pg.goto(f"{pg_stack.base_url}/ui/#/playground")
        pg.fill("#api-key", pg_stack.keys["bob"])
        pg.click("#login-form button")
        pg.wait_for_selector("#playground:not([hidden])")
        pg.wait_for_selector("#play-none", state="visible")  # once the models' list has come (a clean-clone run
        assert pg.locator("#play-model option").count() == 0  # looked before it had)
        sent = chat_requests(pg)
        send(pg, FIRST)
        wait_for_text(pg, "#play-error", "Choose a fine-tuned model first")
        assert sent == [] and pg.input_value("#play-message") == FIRST
        assert pg.evaluate("document.documentElement.scrollWidth") <= 390
        base, tuned_box = pg.locator("#play-base").bounding_box(), pg.locator("#play-tuned").bounding_box()
        assert base and tuned_box and tuned_box["y"] >= base["y"] + base["height"]
    finally:
        ctx.close()
    assert errors == []
