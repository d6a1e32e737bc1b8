"""The chat page at / in a real browser: headless Chromium (Debian's packages, installed here
if missing) driven by Selenium, against a real server. A screenshot goes to test-artifacts/."""
from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from server_process import REPO, ServerProcess

MODEL = "smollm2-135m-instruct"
ARTIFACTS = REPO / "test-artifacts"
WAIT = 120  # seconds any one thing the page shows may take to appear


def _browser_paths() -> tuple[str, str] | None:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def install_browser() -> tuple[str, str]:
    """Chromium and its driver from the distribution's packages. The test needs them: if they
    cannot be installed, it fails, saying why."""
    paths = _browser_paths()
    if paths:
        return paths
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail("the browser test needs chromium and chromedriver: install the Debian "
                    "packages chromium and chromium-driver (apt-get, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", "chromium",
                 "chromium-driver"]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    paths = _browser_paths()
    if paths is None:
        pytest.fail("chromium or chromedriver is still missing after apt-get install")
    return paths


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = install_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,860"):
        options.add_argument(arg)
    # The driver given by path: Selenium must not look for one on the network.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    yield driver
    driver.quit()


def wait_for(driver, predicate, what: str):
    return WebDriverWait(driver, WAIT, poll_frequency=0.05).until(
        lambda d: predicate(d), message=f"the page did not show {what}")


def replies(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def set_field(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def test_chat_streams_stops_and_reports(server, browser):
    browser.get(server.url + "/")
    wait_for(browser, lambda d: d.find_element(By.ID, "model-name").text == MODEL,
             "the model's name")
    set_field(browser, "system", "You are a storyteller.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "1500")

    # A long reply: its text appears while it is still streaming; then it is stopped.
    send(browser, "Tell me a very long story about a dragon and a lighthouse.")
    stop = browser.find_element(By.ID, "stop")
    first = wait_for(browser, lambda d: stop.is_enabled() and replies(d)
                     and replies(d)[0].find_element(By.CLASS_NAME, "text").text,
                     "streamed text while the reply runs")
    wait_for(browser, lambda d: d.find_element(By.ID, "status-running").text == "1",
             "one running request in the live panel")
    wait_for(browser, lambda d: d.find_element(By.ID, "status-users").text == "none: 1 running",
             "the page's own request, of no named user, among the users' shares")
    grown = wait_for(browser, lambda d: len(replies(d)[0].find_element(
        By.CLASS_NAME, "text").text) > len(first) and replies(d)[0].find_element(
        By.CLASS_NAME, "text").text, "the reply growing")
    assert grown.startswith(first)
    stop.click()
    stats = wait_for(browser, lambda d: replies(d)[0].find_elements(By.CLASS_NAME, "stats"),
                     "the stopped reply's stats")[0]
    assert stats.text.endswith("stopped") and int(stats.get_attribute("data-ttft-ms")) > 0
    wait_for(browser, lambda d: d.find_element(By.ID, "status-running").text == "0",
             "the stopped request gone from the live panel")
    wait_for(browser, lambda d: d.find_element(By.ID, "status-users").text == "–",
             "no user holding or awaiting a slot")
    assert httpx.get(server.url + "/status").json()["running"] == 0

    # A short second turn runs to its end, with the conversation so far as its prompt.
    set_field(browser, "max-tokens", "24")
    send(browser, "Now summarise it in one sentence.")
    stats = wait_for(browser, lambda d: len(replies(d)) == 2 and replies(d)[1].find_elements(
        By.CLASS_NAME, "stats"), "the second reply's stats")[0]
    assert replies(browser)[1].find_element(By.CLASS_NAME, "text").text
    assert stats.text.split(" · ")[-1] in ("stop", "length")
    assert float(stats.get_attribute("data-tokens-per-second")) > 0
    assert len(browser.find_elements(By.CSS_SELECTOR, ".message.user")) == 2
    wait_for(browser, lambda d: d.find_element(By.ID, "status-tps").text not in ("", "–"),
             "the server's tokens/s")
    assert browser.find_element(By.ID, "error").get_attribute("hidden")

    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "chat-page.png"))


def test_the_page_and_its_files_are_served_without_an_api_key():
    with ServerProcess("--parallel", "1", "--api-key", "k") as srv:
        page = httpx.get(srv.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            r = httpx.get(f"{srv.url}/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert httpx.get(srv.url + "/status").status_code == 401
        status = httpx.get(srv.url + "/status", headers={"Authorization": "Bearer k"}).json()
        assert set(status) == {"model", "running", "waiting", "kv_usage", "tokens_generated",
                               "users"}
        assert httpx.get(srv.url + "/ui/nope.js", headers={"Authorization": "Bearer k"}
                         ).status_code == 404
