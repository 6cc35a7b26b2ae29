"""The monitoring page in real headless Chromium (Debian's, driven by Playwright): sign in, watch
a job live, see the loss plot draw, download the adapter, cancel, read a validation report."""

from __future__ import annotations

import io
import shutil
import zipfile
from typing import cast

import pytest
from PIL import Image

from tests.conftest import wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, pg_stack):
    ctx = browser.new_context(accept_downloads=True, viewport={"width": 1100, "height": 1400})
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(pg_stack.base_url + "/")
    pg.fill("#api-key", pg_stack.keys["alice"])
    pg.click("#login-form button")
    pg.wait_for_selector("#jobs:not([hidden])")
    yield pg
    ctx.close()
    assert errors == []


@pytest.fixture(scope="module")
def dataset(pg_stack, sample):
    with pg_stack.client() as c:
        up = lambda name: c.post(
            "/v1/files", files={"file": (name, (sample / name).read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        return {
            "training_file": up("train.jsonl"),
            "validation_file": up("validation.jsonl"),
            "images_file": up("images.zip"),
        }


def blue_pixels(png: bytes) -> int:
    """Pixels of the training-loss colour (#2563eb) in a screenshot."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    data = img.get_flattened_data() if hasattr(img, "get_flattened_data") else img.getdata()
    pixels = cast("list[tuple[int, int, int]]", data)
    return sum(1 for r, g, b in pixels if abs(r - 0x25) < 40 and abs(g - 0x63) < 40 and abs(b - 0xEB) < 40)


def test_wrong_key_is_refused(browser, pg_stack):
    pg = browser.new_page()
    pg.goto(pg_stack.base_url + "/ui/")
    pg.fill("#api-key", "sk-kiln-wrong")
    pg.click("#login-form button")
    pg.wait_for_function("document.getElementById('login-error').textContent.length > 0")
    assert "Incorrect API key" in pg.text_content("#login-error")
    assert pg.is_hidden("#jobs")
    pg.close()


def test_watch_a_job_live_and_download_the_adapter(page, pg_stack, dataset):
    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"n_epochs": 2, "batch_size": 8}},
        ).json()
    page.reload()
    page.wait_for_selector(f"tr[data-job='{job['id']}']")
    page.click(f"tr[data-job='{job['id']}']")
    page.wait_for_selector("#job:not([hidden])")
    empty = blue_pixels(page.locator("#loss-plot").screenshot())
    # Live: points arrive over the stream while the job runs, before it has finished.
    page.wait_for_function("Number(document.getElementById('loss-plot').dataset.points) >= 5", timeout=120_000)
    page.wait_for_function("document.getElementById('job-status').textContent === 'succeeded'", timeout=180_000)
    page.wait_for_function("Number(document.getElementById('loss-plot').dataset.points) === 60")
    assert page.get_attribute("#loss-plot", "data-valid-points") == "2"
    shot = page.locator("#loss-plot").screenshot()
    (pg_stack.home / "loss-plot.png").write_bytes(shot)
    assert empty == 0 and blue_pixels(shot) > 300  # the training curve is drawn
    assert page.text_content("#job-step") == "60 / 60"
    assert float(page.text_content("#job-loss")) < 5 and page.text_content("#job-tps") != "-"
    assert page.locator("#ckpt-body tr").count() == 2
    events = page.locator("#events li").all_text_contents()
    assert any("Fine-tuning job started" in e for e in events) and "successfully completed" in events[-1]
    with page.expect_download() as dl:
        page.click("#download")
    path = dl.value.path()
    assert "adapter_model.safetensors" in zipfile.ZipFile(path).namelist()
    with page.expect_download() as dl:
        page.locator("#ckpt-body tr button").first.click()
    assert "adapter_config.json" in zipfile.ZipFile(dl.value.path()).namelist()
    assert page.is_disabled("#cancel")


def test_cancel_from_the_page(page, pg_stack, dataset):
    with pg_stack.client() as c:
        job = c.post(
            "/v1/fine_tuning/jobs",
            json={"model": "kiln-tiny", **dataset, "hyperparameters": {"n_epochs": 30, "batch_size": 4}},
        ).json()
    page.goto(f"{pg_stack.base_url}/ui/#/jobs/{job['id']}")
    page.wait_for_function("Number(document.getElementById('loss-plot').dataset.points) >= 2", timeout=120_000)
    page.click("#cancel")
    page.wait_for_function("document.getElementById('job-status').textContent === 'cancelled'", timeout=60_000)
    assert page.is_disabled("#download")
    with pg_stack.client() as c:
        assert c.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "cancelled"


def test_dataset_validation_report(page, tmp_path):
    page.click("nav a[href='#/files']")
    page.wait_for_selector("#files:not([hidden])")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
        '{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": ""}]}\n'
    )
    page.set_input_files("#upload-file", str(bad))
    page.click("#upload-form button")
    page.wait_for_selector("#report.bad")
    issues = page.locator("#report-issues li").all_text_contents()
    assert issues == [
        "line 2: messages[0].role: unknown role 'robot'; expected one of system, user, assistant",
        "line 2: messages[1].content: empty assistant turn",
    ]
    assert "nothing was stored" in page.text_content("#report-title")
    good = tmp_path / "good.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    page.set_input_files("#upload-file", str(good))
    page.click("#upload-form button")
    page.wait_for_selector("#report.good")
    assert "good.jsonl is valid" in page.text_content("#report-title")
    page.wait_for_function("document.getElementById('report-stats').textContent.includes('estimated_seconds')")
    stats = page.text_content("#report-stats")
    assert "target_tokens" in stats and "length_histogram<=16: 1" in stats
    wait_for(lambda: "good.jsonl" in page.text_content("#files-body"), what="file list")
    assert "bad.jsonl" not in page.text_content("#files-body")
