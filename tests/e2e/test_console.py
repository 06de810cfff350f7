"""The console page in a real browser: headless Chromium (Debian's), a real API, a real node.

`make test` installs `chromium` and `chromium-driver` first (.ci/ensure-chromium); where they could
not be installed the test is skipped, saying so. The screenshot of the finished job is saved under
the test's tmp folder and, when `KILN_TEST_ARTIFACTS` names a folder, there too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from kiln.tasks.api.app import create_app
from kiln.tasks.api.context import build_context
from kiln.tasks.queue import controls
from tests.e2e.cluster import Cluster, WorkerProcess
from tests.tasks.helpers import Api, ThreadServer, api_settings
from tests.waiting import wait_until

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
# What works headless as root on these machines (no sandbox, no GPU, nothing fetched by itself).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,2200",
)
STEPS = 6  # a preview at every step: up to 6 previews of the one job
QUEUE = "interactive.tiny"
PAINTED = "python:tests.e2e.painted_pipelines:painted"
JOB_TIMEOUT_S = 180.0

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no headless Chromium here: `chromium` and `chromium-driver` could not be installed "
    "(.ci/ensure-chromium installs them with apt-get)",
)


@pytest.fixture(scope="module")
def cluster(
    module_cluster_factory: Callable[..., Cluster], tmp_path_factory: pytest.TempPathFactory
) -> Cluster:
    # the default store, a local folder: a page cannot open its file:// paths, only the API's route
    outputs = tmp_path_factory.mktemp("console-outputs")
    made = module_cluster_factory(KILN_STORAGE_URL=f"file://{outputs}")
    made.start_worker("tiny", devices="cpu:1")
    # a node of pipelines of your own: one that emits previews through the protocol's hook, one
    # that cannot emit any
    made.start_worker(
        f"painted={PAINTED}",
        "sleepy=python:tests.e2e.pipelines:sleepy",
        devices="cpu:1",
        extra_env={"KILN_TEST_STEP_SECONDS": "0.1"},
    )
    return made


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Iterator[Api]:
    settings = api_settings(pipelines=["tiny"])  # auth on
    ctx = build_context(settings, cluster.storage_settings)
    with ThreadServer(create_app(settings, cluster.storage_settings, context=ctx)) as server:
        made = Api(server.url, ctx, settings, cluster.storage_settings)
        made.add_key("alice")
        yield made
        ctx.store.redis.close()


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    assert CHROMIUM is not None
    assert CHROMEDRIVER is not None
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory(prefix="kiln-chromium-") as profile:
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


def wait_for(
    driver: WebDriver, what: str, check: Callable[[WebDriver], Any], timeout: float = 30.0
) -> Any:
    """Poll the page until `check` gives something truthy; fail naming `what` and the page."""
    # the lists are redrawn every few seconds: an element may go stale between two looks
    ignored = (NoSuchElementException, StaleElementReferenceException)
    waiting = WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=ignored)
    try:
        return waiting.until(check)
    except Exception as failed:
        text = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(
            f"{what}: not seen within {timeout} s; the page says:\n{text}"
        ) from failed


def shown(driver: WebDriver, element_id: str) -> WebElement | None:
    element = driver.find_element(By.ID, element_id)
    return element if element.is_displayed() else None


def enter_key(driver: WebDriver, key: str) -> None:
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "use-key").click()


def fill(driver: WebDriver, selector: str, value: str) -> None:
    field = driver.find_element(By.CSS_SELECTOR, selector)
    field.clear()
    field.send_keys(value)


def loaded_images(driver: WebDriver, selector: str) -> int:
    """How many images matching `selector` have loaded and decoded (naturalWidth > 0)."""
    count = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".filter(img => img.complete && img.naturalWidth > 0).length",
        selector,
    )
    return int(count)


def save_screenshot(driver: WebDriver, folder: Path) -> Path:
    path = folder / "console.png"
    assert driver.save_screenshot(str(path)), "the browser took no screenshot"
    artifacts = os.environ.get("KILN_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / path.name)
    print(f"console screenshot: {path}" + (f" (and in {artifacts})" if artifacts else ""))
    return path


def test_without_a_key_the_page_asks_for_one_and_shows_the_apis_error_for_a_wrong_one(
    api: Api, browser: WebDriver
) -> None:
    browser.get(f"{api.url}/console")  # redirected to /console/
    wait_for(browser, "the key form", lambda d: shown(d, "auth"))
    assert not browser.find_element(By.ID, "app").is_displayed()
    assert not browser.find_element(By.ID, "auth-error").is_displayed()

    wrong = "kiln_" + "0" * 40
    refused = httpx.get(f"{api.url}/v1/pipelines", headers={"Authorization": f"Bearer {wrong}"})
    assert refused.status_code == 401
    message = refused.json()["detail"]
    enter_key(browser, wrong)
    error = wait_for(browser, "the API's 401 message", lambda d: shown(d, "auth-error"))
    assert error.text == message
    assert not browser.find_element(By.ID, "app").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('kiln.apiKey')") is None


def test_a_job_submitted_from_the_page_shows_its_previews_and_its_output(
    api: Api, cluster: Cluster, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(f"{api.url}/console/")
    wait_for(browser, "the key form", lambda d: shown(d, "auth"))
    enter_key(browser, api.keys["alice"])
    wait_for(browser, "the console", lambda d: shown(d, "app"))
    # the key stays in this tab's session, never in the page's address
    assert (
        browser.execute_script("return sessionStorage.getItem('kiln.apiKey')") == api.keys["alice"]
    )
    assert api.keys["alice"] not in browser.current_url
    # the form is the pipeline's own schema, as its live node announces it
    choose(browser, "tiny", "steps")
    node = cluster.workers[0].node_id
    wait_for(
        browser,
        "the node in the nodes table",
        lambda d: node in d.find_element(By.ID, "nodes-body").text,
    )

    fill(browser, "#fields [data-field=prompt]", "a kiln at dusk, glowing")
    fill(browser, "#fields [data-field=width]", "64")
    fill(browser, "#fields [data-field=height]", "64")
    fill(browser, "#fields [data-field=steps]", str(STEPS))
    fill(browser, "#fields [data-field=seed]", "7")
    fill(browser, "#preview-every", "1")
    # Redis keeps only a job's newest preview: the job waits in its paused queue until the page
    # follows its events, so every preview reaches the page live, however slow this machine is.
    hold_queue(cluster, cluster.workers[0], QUEUE)
    submit_live(browser)
    assert browser.find_element(By.ID, "watch-status").text == "queued"
    assert "ahead in the queue" in browser.find_element(By.ID, "watch-detail").text
    controls.resume(cluster.store, QUEUE)

    wait_for_output(browser, "the output image", lambda d: loaded_images(d, "img.output") >= 1)
    job_id = browser.find_element(By.ID, "watch-id").text
    assert cluster.store.get(job_id).state == "succeeded"
    assert browser.find_element(By.ID, "watch-status").text == "succeeded"
    previews = loaded_images(browser, "img.preview")
    assert previews >= 2, f"{previews} previews shown"
    # the jobs table lists it as finished (it refreshes every few seconds)
    wait_for(
        browser,
        "the job in the jobs table",
        lambda d: (
            "succeeded"
            in d.find_element(By.CSS_SELECTOR, f"#jobs-body tr[data-id='{job_id}']").text
        ),
    )
    path = save_screenshot(browser, tmp_path)
    assert path.stat().st_size > 0


def hold_queue(cluster: Cluster, worker: WorkerProcess, queue: str) -> None:
    """Pause `queue` and wait until `worker` stops consuming it (the job waits for the page)."""
    controls.pause(cluster.store, queue, by="test_console")
    wait_until(
        lambda: worker.heartbeat() or {},
        lambda beat: queue not in beat.get("consuming", [queue]),
        what=f"{worker.node_id} not consuming {queue}",
    )


def submit_live(browser: WebDriver) -> None:
    """Submit the form and wait until the page follows the job's events (no submit error)."""
    browser.find_element(By.ID, "submit-job").click()
    wait_for(
        browser,
        "the job's live event stream",
        lambda d: (
            d.find_element(By.ID, "watch").get_attribute("data-stream") == "live"
            or shown(d, "submit-error")
        ),
    )
    submit_error = browser.find_element(By.ID, "submit-error")
    assert not submit_error.is_displayed(), submit_error.text


def wait_for_output(browser: WebDriver, what: str, ready: Callable[[WebDriver], Any]) -> None:
    """Wait until `ready`; fail on a watch error shown instead (a failed job, a refused stream)."""
    wait_for(browser, what, lambda d: ready(d) or shown(d, "watch-error"), timeout=JOB_TIMEOUT_S)
    watch_error = browser.find_element(By.ID, "watch-error")
    assert not watch_error.is_displayed(), watch_error.text


def field_names(driver: WebDriver) -> set[str]:
    return {
        str(element.get_attribute("data-field") or element.get_attribute("name"))
        for element in driver.find_elements(
            By.CSS_SELECTOR, "#fields input, #fields select, #fields textarea"
        )
    }


def choose(driver: WebDriver, pipeline: str, field: str) -> None:
    """Pick `pipeline` and wait until its own form (not the one shown before) shows `field`.

    Another pipeline's form may have the same field: filled before the chosen one's replaced
    it, the page would submit the chosen form empty (the browser blocks a required field).
    """
    Select(driver.find_element(By.ID, "pipeline")).select_by_value(pipeline)
    wait_for(
        driver,
        f"the {pipeline} pipeline's fields",
        lambda d: d.find_elements(
            By.CSS_SELECTOR, f'#fields[data-pipeline="{pipeline}"] [data-field={field}]'
        ),
    )


def test_a_python_pipelines_form_previews_image_and_video_open_from_a_local_store(
    api: Api, cluster: Cluster, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(f"{api.url}/console/")
    wait_for(browser, "the key form", lambda d: shown(d, "auth"))
    enter_key(browser, api.keys["alice"])
    wait_for(
        browser,
        "the node's pipelines in the list",
        lambda d: (
            {"painted", "sleepy"}
            <= {
                o.get_attribute("value")
                for o in d.find_elements(By.CSS_SELECTOR, "#pipeline option")
            }
        ),
        timeout=60,
    )
    # a pipeline that cannot emit previews: the form offers none (its request would be a 422)
    choose(browser, "sleepy", "num_frames")
    wait_for(
        browser,
        "no previews offered",
        lambda d: not d.find_element(By.ID, "preview-on").is_enabled(),
    )
    assert browser.find_element(By.ID, "preview-none").is_displayed()

    # the fields `painted` declares it honours, and no others (no guidance, no negative prompt)
    choose(browser, "painted", "num_frames")
    wait_for(
        browser, "previews offered", lambda d: d.find_element(By.ID, "preview-on").is_enabled()
    )
    names = field_names(browser)
    assert {"prompt", "width", "height", "steps", "seed", "num_frames", "num_outputs"} <= names
    assert {"output_format", "fps"} <= names  # it makes videos: formats and frame rate
    assert not {"guidance_scale", "negative_prompt"} & names
    assert browser.find_element(By.ID, "preview-on").is_selected()

    fill(browser, "#fields [data-field=prompt]", "a ramp of colour")
    fill(browser, "#fields [data-field=width]", "96")
    fill(browser, "#fields [data-field=height]", "64")
    fill(browser, "#fields [data-field=steps]", str(STEPS))
    fill(browser, "#fields [data-field=seed]", "11")
    fill(browser, "#preview-every", "1")
    # the job waits for the page to follow it, as in the test above
    painted_queue = "interactive.painted"
    hold_queue(cluster, cluster.workers[1], painted_queue)  # the node of the python: pipelines
    submit_live(browser)
    controls.resume(cluster.store, painted_queue)
    wait_for_output(browser, "the painted image", lambda d: loaded_images(d, "img.output") >= 1)
    image_job = browser.find_element(By.ID, "watch-id").text
    assert cluster.store.get(image_job).state == "succeeded"
    previews = loaded_images(browser, "img.preview")
    assert previews >= 2, f"{previews} previews of the painted pipeline shown"
    size = browser.execute_script(
        "const img = document.querySelector('img.output');"
        "return [img.naturalWidth, img.naturalHeight, img.src];"
    )
    assert size[:2] == [96, 64]
    assert size[2].startswith("blob:")  # fetched with the key through the outputs route
    link = browser.find_element(By.CSS_SELECTOR, "#outputs a.download")
    assert link.get_attribute("download") == f"{image_job}-0.png"
    assert "file://" not in browser.find_element(By.ID, "outputs").text

    # the same pipeline, a video: 9 frames of WebM, played in the page
    fill(browser, "#fields [data-field=num_frames]", "9")
    Select(
        browser.find_element(By.CSS_SELECTOR, "#fields [data-field=output_format]")
    ).select_by_visible_text("webm")
    browser.find_element(By.ID, "preview-on").click()  # no previews this time
    browser.find_element(By.ID, "submit-job").click()
    wait_for(
        browser,
        "the video job on show",
        lambda d: d.find_element(By.ID, "watch-id").text not in ("", image_job),
    )
    wait_for_output(
        browser,
        "the video playing",
        lambda d: d.execute_script(
            "const v = document.querySelector('video.output');"
            "return v !== null && v.readyState >= 2 && v.videoWidth === 96;"
        ),
    )
    video_job = browser.find_element(By.ID, "watch-id").text
    record = cluster.store.get(video_job)
    assert record.state == "succeeded"
    assert record.outputs[0]["content_type"] == "video/webm"
    assert record.outputs[0]["storage_url"].startswith("file://")
    assert loaded_images(browser, "img.preview") == 0
    path = save_screenshot(browser, tmp_path)
    assert path.stat().st_size > 0


def test_a_job_paused_and_resumed_from_the_page_runs_to_its_end(
    api: Api, cluster: Cluster, browser: WebDriver
) -> None:
    # the job waits in its held queue, so the page pauses it while it is queued, for sure
    hold_queue(cluster, cluster.workers[0], QUEUE)
    body = {"prompt": "a paused kiln", "pipeline": "tiny", "width": 64, "height": 64, "steps": 2}
    created = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    browser.get(f"{api.url}/console/")
    wait_for(browser, "the key form", lambda d: shown(d, "auth"))
    enter_key(browser, api.keys["alice"])
    row = f"#jobs-body tr[data-id='{job_id}'] button.link"
    wait_for(browser, "the job in the jobs table", lambda d: d.find_element(By.CSS_SELECTOR, row))
    browser.find_element(By.CSS_SELECTOR, row).click()
    wait_for(browser, "the pause button", lambda d: shown(d, "watch-pause"))
    assert not browser.find_element(By.ID, "watch-resume").is_displayed()

    browser.find_element(By.ID, "watch-pause").click()
    wait_for(browser, "the resume button", lambda d: shown(d, "watch-resume"))
    assert browser.find_element(By.ID, "watch-status").text == "paused"
    assert not browser.find_element(By.ID, "watch-pause").is_displayed()
    assert cluster.store.get(job_id).state == "paused"

    browser.find_element(By.ID, "watch-resume").click()
    wait_for(browser, "the job queued again", lambda d: shown(d, "watch-pause"))
    assert cluster.store.get(job_id).state in ("queued", "running", "succeeded")
    controls.resume(cluster.store, QUEUE)
    wait_for(
        browser,
        "the resumed job's end",
        lambda d: d.find_element(By.ID, "watch-status").text == "succeeded",
        timeout=JOB_TIMEOUT_S,
    )
    types = [e.type for e in cluster.store.events(job_id, count=100)]
    assert types.index("paused") < types.index("resumed") < types.index("succeeded")
