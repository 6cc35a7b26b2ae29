"""The monitoring page in real headless Chromium (Debian's, driven by Playwright): sign in, watch
a job live (loss plot, checkpoints), download the adapter, cancel, pause and resume, create a job
from the form, read a dataset's report with its images, and fit a phone's 390 px width."""

from __future__ import annotations

import io
import re
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


def sign_in(browser, pg_stack, viewport: dict[str, int]):
    """A fresh context signed in as alice; returns (context, page, page errors)."""
    ctx = browser.new_context(accept_downloads=True, viewport=viewport)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(pg_stack.base_url + "/")
    pg.fill("#api-key", pg_stack.keys["alice"])
    pg.click("#login-form button")
    pg.wait_for_selector("#jobs:not([hidden])")
    return ctx, pg, errors


@pytest.fixture
def page(browser, pg_stack):
    ctx, pg, errors = sign_in(browser, pg_stack, {"width": 1100, "height": 1400})
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
    # the columns: step, losses, token accuracy, exact match (the last step's answers to the
    # validation prompts, engine.inference.evaluate), the download
    rows = {r[0]: r for r in (tr.locator("td").all_text_contents() for tr in page.locator("#ckpt-body tr").all())}
    assert set(rows) == {"30", "60"}
    assert re.fullmatch(r"\d+\.\d%", rows["60"][4]) and rows["30"][4] == ""  # the last step's only
    assert all(re.fullmatch(r"\d+\.\d%", r[3]) for r in rows.values())
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
    page.wait_for_selector("#report .report.bad")
    issues = page.locator("#report .report-issues li").all_text_contents()
    assert issues == [
        "line 2: messages[0].role: unknown role 'robot'; expected one of system, user, assistant",
        "line 2: messages[1].content: empty assistant turn",
    ]
    assert "nothing was stored" in page.text_content("#report .report-title")
    assert "bad.jsonl was refused" in page.text_content("#upload-result")
    good = tmp_path / "good.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    page.set_input_files("#upload-file", str(good))
    page.click("#upload-form button")
    page.wait_for_selector("#report .report.good")
    assert "good.jsonl is valid" in page.text_content("#upload-result")
    assert page.text_content("#report .report-title") == "good.jsonl: ok for kiln-tiny"
    stats = stats_of(page.locator("#report"))
    assert int(stats["target_tokens"]) > 0 and stats["length_histogram"] == "<=16: 1"
    assert float(stats["estimated_seconds"]) >= 0
    wait_for(lambda: "good.jsonl" in page.text_content("#files-body"), what="file list")
    assert "bad.jsonl" not in page.text_content("#files-body")


# ---- issue #30: create a job from the page, live checkpoints, image reports, a phone's width ----

PHONE = {"width": 390, "height": 844}
FINISHED = ("succeeded", "failed", "cancelled")


def start_job(pg_stack, dataset, **hyperparameters) -> dict:
    with pg_stack.client() as c:
        r = c.post("/v1/fine_tuning/jobs", json={"model": "kiln-tiny", **dataset, "hyperparameters": hyperparameters})
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_finished(pg_stack, job_id: str) -> dict:
    with pg_stack.client() as c:
        return wait_for(
            lambda: (j := c.get(f"/v1/fine_tuning/jobs/{job_id}").json())["status"] in FINISHED and j,
            timeout=240,
            what=f"job {job_id} to finish",
        )


@pytest.fixture(scope="module")
def finished_job(pg_stack, dataset):
    """A short job that has succeeded: 8 steps, so 8 loss points and a checkpoint each 4 steps."""
    job = start_job(pg_stack, dataset, max_steps=8, batch_size=4, checkpoint_interval=4)
    job = wait_until_finished(pg_stack, job["id"])
    assert job["status"] == "succeeded", job
    return job


def stats_of(report) -> dict[str, str]:
    """A report's numbers, name to text."""
    return dict(zip(report.locator("dt").all_text_contents(), report.locator("dd").all_text_contents(), strict=True))


def open_job(pg, pg_stack, job: dict, points: int) -> None:
    pg.goto(f"{pg_stack.base_url}/ui/#/jobs/{job['id']}")
    pg.wait_for_function(f"document.getElementById('job-status').textContent === '{job['status']}'")
    pg.wait_for_function(f"Number(document.getElementById('loss-plot').dataset.points) === {points}")


def wait_for_text(page, selector: str, text: str) -> None:
    """Until the first element that `selector` matches (there may be none yet) holds `text`."""
    page.wait_for_function(
        "([sel, text]) => (document.querySelector(sel)?.textContent || '').includes(text)", arg=[selector, text]
    )


def png(color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, format="PNG")
    return out.getvalue()


def submit_and_read_error(page) -> dict:
    """Submit the form; the server's answer must be a 4xx, which is returned."""
    with page.expect_response(lambda r: r.url.endswith("/v1/fine_tuning/jobs") and r.request.method == "POST") as res:
        page.click("#new-submit")
    assert 400 <= res.value.status < 500
    return res.value.json()["error"]


def test_create_a_job_through_the_form(page, pg_stack, dataset):
    page.click("nav a[href='#/new']")
    page.wait_for_selector("#new:not([hidden]) #new-training option", state="attached")
    with pg_stack.client() as c:
        base_models = [m["id"] for m in c.get("/v1/models").json()["data"] if not m.get("root")]
    assert page.locator("#new-model option").all_text_contents() == base_models  # no fine-tuned ones
    page.select_option("#new-training", dataset["training_file"])
    page.select_option("#new-validation", dataset["validation_file"])
    # Without its images the training file's report names every image it cannot find.
    page.select_option("#new-images", "")
    page.wait_for_selector("#new-report .report.bad")
    training = page.locator("#new-report .report").first
    assert "problem(s) for kiln-tiny" in training.locator(".report-title").text_content()
    missing = training.locator(".report-issues li").all_text_contents()
    assert missing and missing[0].startswith("line 1: images[0]: image 'images/train_0000.png' not found")
    page.select_option("#new-images", dataset["images_file"])
    page.fill("#new-n_epochs", "2")
    page.locator("#new-n_epochs").dispatch_event("change")  # as when the field loses focus
    page.wait_for_function("document.querySelectorAll('#new-report .report.good').length === 2")
    title = training.locator(".report-title").text_content()
    assert title == f"Training file train.jsonl ({dataset['training_file']}): ok for kiln-tiny"
    stats = stats_of(training)
    assert (stats["examples"], stats["images"]) == ("240", "147")
    assert int(stats["estimated_training_tokens"]) == 2 * int(stats["tokens"])  # the form's two epochs
    assert float(stats["estimated_seconds"]) > 0 and stats["length_histogram"].startswith("<=")
    page.fill("#new-batch_size", "4")
    page.fill("#new-learning_rate_multiplier", "0.5")
    page.fill("#new-max_steps", "2")
    page.fill("#new-max_seq_len", "512")
    page.click("#new-form summary")
    page.fill("#new-advanced", '{"warmup_ratio": 0.1, "checkpoint_interval": 1}')
    page.fill("#new-rank", "4")
    page.fill("#new-alpha", "8")
    page.fill("#new-targets", "q_proj, v_proj")
    page.fill("#new-suffix", "from-the-form")
    page.click("#new-submit")
    page.wait_for_selector("#job:not([hidden])")
    page.wait_for_function("document.getElementById('job-id').textContent.startsWith('ftjob-')")
    job_id = page.text_content("#job-id")
    assert page.evaluate("location.hash") == f"#/jobs/{job_id}"
    with pg_stack.client() as c:
        job = c.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["model"] == "kiln-tiny" and job["suffix"] == "from-the-form"
    assert (job["training_file"], job["validation_file"], job["images_file"]) == (
        dataset["training_file"],
        dataset["validation_file"],
        dataset["images_file"],
    )
    hp = job["method"]["supervised"]["hyperparameters"]
    assert {k: hp[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier")} == {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": 0.5,
    }
    assert (hp["max_steps"], hp["max_seq_len"], hp["warmup_ratio"], hp["checkpoint_interval"]) == (2, 512, 0.1, 1)
    assert (job["lora"]["rank"], job["lora"]["alpha"], job["lora"]["target_modules"]) == (4, 8, ["q_proj", "v_proj"])
    wait_until_finished(pg_stack, job_id)  # the worker is free for the next test


def test_the_form_shows_the_servers_error_and_keeps_what_was_typed(page, pg_stack, dataset):
    with pg_stack.client() as c:
        jobs_before = len(c.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"])
    page.goto(f"{pg_stack.base_url}/ui/#/new")
    page.wait_for_selector("#new:not([hidden]) #new-training option", state="attached")
    page.select_option("#new-training", dataset["training_file"])
    page.select_option("#new-images", dataset["images_file"])
    typed = {
        "#new-learning_rate_multiplier": "-1",
        "#new-max_steps": "3",
        "#new-targets": "q_proj, warp_drive",
        "#new-suffix": "keep-me",
    }
    for field, text in typed.items():
        page.fill(field, text)
    err = submit_and_read_error(page)
    assert err["param"] == "hyperparameters.learning_rate_multiplier"
    page.wait_for_function("document.getElementById('new-error').textContent.length > 0")
    assert page.text_content("#new-error") == f"{err['message']} (field: {err['param']})"
    assert page.get_attribute("#new-learning_rate_multiplier", "class") == "invalid"
    # The refused answer is shown beside the form, which stays as it was.
    assert page.is_visible("#new") and page.evaluate("location.hash") == "#/new"
    for field, text in typed.items():
        assert page.input_value(field) == text
    assert page.input_value("#new-training") == dataset["training_file"]
    assert page.input_value("#new-images") == dataset["images_file"]

    page.fill("#new-learning_rate_multiplier", "0.5")
    err = submit_and_read_error(page)
    assert err["param"] == "lora.target_modules" and "warp_drive" in err["message"]
    page.wait_for_function("document.getElementById('new-error').textContent.includes('warp_drive')")
    assert page.text_content("#new-error") == f"{err['message']} (field: lora.target_modules)"
    assert page.get_attribute("#new-targets", "class") == "invalid"
    assert page.get_attribute("#new-learning_rate_multiplier", "class") in ("", None)

    # Advanced hyperparameters: JSON the page cannot read is refused before any request, a
    # hyperparameter the server refuses marks the advanced field (and opens it).
    page.fill("#new-targets", "q_proj")
    page.click("#new-form summary")
    page.fill("#new-advanced", "{warmup_ratio: 0.1")
    page.click("#new-submit")
    page.wait_for_function("document.getElementById('new-error').textContent.includes('not valid JSON')")
    assert page.get_attribute("#new-advanced", "class") == "invalid"
    page.fill("#new-advanced", '{"warmup_ratio": 0.9}')
    page.click("#new-form summary")  # closed: the server's refusal opens it again
    assert page.get_attribute("#new-form details", "open") is None
    err = submit_and_read_error(page)
    assert err["param"] == "hyperparameters.warmup_ratio"
    page.wait_for_function("document.getElementById('new-error').textContent.includes('warmup_ratio')")
    assert page.get_attribute("#new-advanced", "class") == "invalid"
    assert page.get_attribute("#new-form details", "open") is not None
    with pg_stack.client() as c:
        assert len(c.get("/v1/fine_tuning/jobs", params={"limit": 100}).json()["data"]) == jobs_before


SNAPSHOT_AT_TWO_CHECKPOINTS = """() => {
  const status = document.getElementById('job-status').textContent;
  const checkpoints = document.querySelectorAll('#ckpt-body tr').length;
  const shown = (id) => !document.getElementById(id).hidden;
  const done = ['succeeded', 'failed', 'cancelled'].includes(status);
  return (checkpoints >= 2 || done) && { checkpoints, status, pause: shown('pause'), resume: shown('resume') };
}"""


def test_checkpoints_appear_while_the_job_runs(page, pg_stack, dataset):
    job = start_job(pg_stack, dataset, max_steps=6, batch_size=4, checkpoint_interval=1)
    page.goto(f"{pg_stack.base_url}/ui/#/jobs/{job['id']}")
    page.wait_for_selector("#job:not([hidden])")
    # The first moment the page shows two checkpoints or a finished job, it must still say running:
    # the checkpoints came in live, not at the job's end.
    seen = page.wait_for_function(SNAPSHOT_AT_TWO_CHECKPOINTS, timeout=180_000).json_value()
    assert seen == {"checkpoints": seen["checkpoints"], "status": "running", "pause": True, "resume": False}
    page.wait_for_function("document.getElementById('job-status').textContent === 'succeeded'", timeout=180_000)
    page.wait_for_function("document.querySelectorAll('#ckpt-body tr').length === 6")
    steps = page.locator("#ckpt-body tr td:first-child").all_text_contents()
    assert sorted(map(int, steps)) == [1, 2, 3, 4, 5, 6]
    assert page.is_hidden("#pause") and page.is_hidden("#resume")


def test_pause_and_resume_from_the_page(page, pg_stack, dataset):
    # long enough that the cancel below lands before the last step on a fast machine (30 did not)
    job = start_job(pg_stack, dataset, max_steps=180, batch_size=4, checkpoint_interval=1000)
    page.goto(f"{pg_stack.base_url}/ui/#/jobs/{job['id']}")
    points = "Number(document.getElementById('loss-plot').dataset.points)"
    status = "document.getElementById('job-status').textContent"
    page.wait_for_function(f"{points} >= 3 && {status} === 'running'", timeout=180_000)
    assert page.is_visible("#pause") and page.is_hidden("#resume")
    page.click("#pause")
    page.wait_for_function(f"{status} === 'paused'", timeout=120_000)
    assert page.is_hidden("#pause") and page.is_visible("#resume")
    at = page.evaluate(points)
    assert at < 180
    page.wait_for_function("document.querySelectorAll('#ckpt-body tr').length === 1")  # saved where it paused
    page.click("#resume")
    page.wait_for_function(f"{points} > {at} && {status} === 'running'", timeout=180_000)
    assert page.is_visible("#pause") and page.is_hidden("#resume")
    assert page.text_content("#action-error") == ""
    # A refusal is shown beside the buttons: the page stops listening, the job is cancelled behind
    # its back, and its Pause is then refused.
    page.evaluate("stopStream()")
    with pg_stack.client() as c:
        assert c.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").status_code == 200
    assert wait_until_finished(pg_stack, job["id"])["status"] == "cancelled"
    with page.expect_response(lambda r: r.url.endswith("/pause")) as res:
        page.click("#pause")
    assert res.value.status == 409
    wait_for_text(page, "#action-error", res.value.json()["error"]["message"])


def test_datasets_page_reports_image_problems(page, pg_stack, dataset, tmp_path):
    def example(image: str) -> str:
        return (
            f'{{"images": ["{image}"], "messages": [{{"role": "user", "content": "<image>"}},'
            ' {"role": "assistant", "content": "red"}]}\n'
        )

    data = tmp_path / "pictures.jsonl"
    data.write_text(example("images/train_0000.png") + example("images/nowhere.png"))
    page.click("nav a[href='#/files']")
    page.wait_for_selector("#files:not([hidden])")
    page.select_option("#report-images", "")
    page.set_input_files("#upload-file", str(data))
    page.click("#upload-form button")
    # No images zip chosen: both lines' images are missing, and each problem is listed.
    page.wait_for_selector("#report .report.bad")
    assert page.text_content("#report .report-title") == "pictures.jsonl: 2 problem(s) for kiln-tiny"
    issues = page.locator("#report .report-issues li").all_text_contents()
    assert [i.split(": image ")[0] for i in issues] == ["line 1: images[0]", "line 2: images[0]"]
    assert "upload the images as a zip" in issues[0]
    # An uploaded images zip, chosen from the list: only the image it lacks is a problem.
    page.select_option("#report-images", dataset["images_file"])
    wait_for_text(page, "#report .report-title", "1 problem")
    assert page.locator("#report .report-issues li").all_text_contents() == [
        "line 2: images[0]: image 'images/nowhere.png' not found in the uploaded archive"
    ]
    # A new images zip uploaded from the page is chosen at once and the report asked again.
    archive = tmp_path / "more-images.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("images/nowhere.png", png("red"))
    page.set_input_files("#upload-file", str(archive))
    page.click("#upload-form button")
    page.wait_for_function("document.getElementById('upload-result').textContent.includes('an images zip')")
    new_zip = page.text_content("#upload-result").split("stored as ")[1].split(",")[0]
    page.wait_for_function("id => document.getElementById('report-images').value === id", arg=new_zip)
    wait_for_text(page, "#report .report-issues li", "line 1:")
    assert page.locator("#report .report-issues li").all_text_contents() == [
        "line 1: images[0]: image 'images/train_0000.png' not found in the uploaded archive"
    ]
    # Clicking a dataset's row asks for its report with the chosen images.
    page.locator("#files-body tr", has_text="train.jsonl").first.click()
    wait_for_text(page, "#report .report-title", "train.jsonl")
    page.wait_for_selector("#report .report.bad")
    assert len(page.locator("#report .report-issues li").all_text_contents()) > 1


def test_job_page_fits_a_phone(browser, pg_stack, finished_job):
    ctx, pg, errors = sign_in(browser, pg_stack, PHONE)
    width = "document.documentElement.scrollWidth"
    try:
        open_job(pg, pg_stack, finished_job, 8)
        assert pg.locator("#ckpt-body tr").count() == 2 and pg.locator("#events li").count() > 5
        assert pg.text_content("#job-ft").startswith("ft:kiln-tiny:")  # long, and without spaces
        assert pg.evaluate(width) <= 390, pg.evaluate(width)
        assert pg.evaluate("document.getElementById('loss-plot').getBoundingClientRect().right") <= 390
        for hash_, section in (("#/", "#jobs"), ("#/new", "#new"), ("#/files", "#files")):
            pg.goto(f"{pg_stack.base_url}/ui/{hash_}")
            pg.wait_for_selector(f"{section}:not([hidden])")
            assert pg.evaluate(width) <= 390, hash_
    finally:
        ctx.close()
    assert errors == []


def test_rows_look_and_act_clickable(page, pg_stack, finished_job):
    row = page.locator(f"tr[data-job='{finished_job['id']}']")
    assert row.evaluate("r => getComputedStyle(r).cursor") == "pointer"
    assert row.locator("a").get_attribute("href") == f"#/jobs/{finished_job['id']}"
    before = row.evaluate("r => getComputedStyle(r).backgroundColor")
    row.locator("td").nth(3).hover()
    assert row.evaluate("r => getComputedStyle(r).backgroundColor") != before
    row.locator("td").nth(1).click()  # anywhere on the row, not only the link
    page.wait_for_selector("#job:not([hidden])")
    # the panel may still show the job an earlier test opened until this one's loads
    wait_for_text(page, "#job-id", finished_job["id"])
    page.click("nav a[href='#/files']")
    page.wait_for_selector("#files-body tr")
    assert page.locator("#files-body tr").first.evaluate("r => getComputedStyle(r).cursor") == "pointer"


# Counts the tick marks on the loss plot's axes, from the canvas's own pixels: the axes are the
# row and the column with the most pixels of the axis colour; ticks cross the row 3 pixels
# below the x axis and the column 3 pixels left of the y axis.
COUNT_TICKS = """() => {
  const c = document.getElementById('loss-plot'), W = c.width, H = c.height;
  const d = c.getContext('2d').getImageData(0, 0, W, H).data;
  const axis = (x, y) => {
    const i = 4 * (y * W + x);
    const near = (k, v) => Math.abs(d[i + k] - v) < 10;
    return d[i + 3] > 200 && near(0, 0x9c) && near(1, 0xa3) && near(2, 0xaf);
  };
  const count = (n, at) => { let k = 0; for (let i = 0; i < n; i++) k += at(i); return k; };
  const runs = (n, at) => { let k = 0; for (let i = 0; i < n; i++) k += at(i) && !(i && at(i - 1)); return k; };
  let row = 0, col = 0;
  for (let y = 0; y < H; y++) if (count(W, (x) => axis(x, y)) > count(W, (x) => axis(x, row))) row = y;
  for (let x = 0; x < W; x++) if (count(H, (y) => axis(x, y)) > count(H, (y) => axis(col, y))) col = x;
  return { x: runs(W, (x) => axis(x, row + 3)), y: runs(H, (y) => axis(col - 3, y)) };
}"""


def test_loss_plot_axes_have_ticks_and_labels(page, pg_stack, finished_job):
    open_job(page, pg_stack, finished_job, 8)
    x_ticks = [int(t) for t in page.get_attribute("#loss-plot", "data-x-ticks").split()]
    y_ticks = [float(t) for t in page.get_attribute("#loss-plot", "data-y-ticks").split()]
    assert x_ticks[0] == 0 and x_ticks[-1] == 8 and len(x_ticks) >= 3  # steps 0..8, round numbers
    assert x_ticks == sorted(set(x_ticks)) and y_ticks == sorted(set(y_ticks)) and len(y_ticks) >= 2
    events = " ".join(page.locator("#events li").all_text_contents())
    losses = [float(x) for x in re.findall(r"loss=([0-9.]+)", events)]  # training and validation
    assert len(losses) == 8 + 2
    assert min(losses) - 1e-3 <= y_ticks[0] and y_ticks[-1] <= max(losses) + 1e-3  # inside the curves' range
    assert page.evaluate(COUNT_TICKS) == {"x": len(x_ticks), "y": len(y_ticks)}
