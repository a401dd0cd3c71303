"""The chat page of `quickdraft serve` in a real browser: headless Chromium from the system's packages, driven by
Selenium through the system chromedriver (nothing downloads a browser), against a real server on a real model
(smollm2-135m drafting with its int4 copy and n-gram lookup, behind an API key).

Every name but 127.0.0.1 fails to resolve in this browser, so the page is shown to work with no network.
Screenshots go to $QUICKDRAFT_SCREENSHOTS (default: the test's temporary folder).
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests import loopback
from quickdraft.tools.servers import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
KEY = "page-test-key"
# greedy answers of smollm2-135m that run past 80 tokens, with drafts kept from the draft model and from n-gram lookup
CODE = "Write a Python function that checks whether a number is prime, then explain it."
TABLE = "Write the multiplication table of 7, from 7 x 1 to 7 x 12, one per line."


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for program in ("chromium", "chromedriver"):
        if not shutil.which(program):
            return f"no {program} on PATH: install Debian's chromium and chromium-driver (.ci/run does)"
    return None


@pytest.fixture(scope="module")
def server(real_model_path):
    real_model_path(MODEL)
    with ServerProcess("-m", MODEL, "--draft", MODEL, "--ngram", "--ctx", "1024", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("QUICKDRAFT_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser(server):
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--no-first-run",
                "--disable-background-networking", "--disable-component-update"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait(predicate, timeout=120, what="the page"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen in {timeout} s")


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def set_field(driver, element_id, value):
    js(driver, "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
               "e.dispatchEvent(new Event('change'));", element_id, value)


def send(driver, prompt):
    from selenium.webdriver.common.keys import Keys
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(prompt)
    box.send_keys(Keys.ENTER)  # Enter sends


def last_answer(driver):
    return driver.find_elements("css selector", ".msg.assistant")[-1]


def answers(driver) -> int:
    return len(driver.find_elements("css selector", ".msg.assistant"))


def finished(driver, count):
    def done():
        found = driver.find_elements("css selector", ".msg.assistant")
        return len(found) >= count and all(a.get_attribute("data-finish") for a in found[:count])
    wait(done, what="the answer's end")
    return last_answer(driver)


def coloured_tokens(answer) -> dict:
    return answer.parent.execute_script("""
        const seen = {draft: new Set(), ngram: new Set()};
        for (const s of arguments[0].querySelectorAll('.body .tok.draft, .body .tok.ngram'))
            seen[s.classList.contains('draft') ? 'draft' : 'ngram'].add(s.dataset.t);
        return {draft: seen.draft.size, ngram: seen.ngram.size};""", answer)


@pytest.fixture(scope="module")
def page(browser, server):
    """The page, loaded, with the API key given once in its dialog."""
    browser.get(server.url + "/")
    dialog = wait(lambda: browser.find_element("id", "key-dialog").is_displayed() and
                  browser.find_element("id", "key-dialog"), 30, "the API key dialog")
    browser.find_element("id", "key").send_keys(KEY + "\n")
    wait(lambda: MODEL in browser.find_element("id", "model").text, 30, "the model's name")
    assert not dialog.is_displayed()
    return browser


def test_the_page_loads_with_no_network_and_asks_for_the_key_once(page, server):
    resources = js(page, "return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(server.url) for r in resources), resources
    assert js(page, "return sessionStorage.getItem('quickdraft-api-key')") == KEY  # kept for this tab only
    page.refresh()  # a reload in the same tab does not ask again
    wait(lambda: MODEL in page.find_element("id", "model").text, 30, "the model's name after a reload")
    assert not page.find_element("id", "key-dialog").is_displayed()
    # the page needs no key, the API still does
    assert loopback.get(server.url + "/").status_code == 200
    assert loopback.get(server.url + "/v1/models").status_code == 401


def test_an_answer_streams_with_its_tokens_coloured_by_source(page, shots):
    from selenium.webdriver.common.keys import Keys
    set_field(page, "max-tokens", "80")
    # k fixed: each round lookup drafts where it has a match and the draft model elsewhere, so which drafters show is
    # the greedy answer's, not the adaptive policy's timing on a shared CPU (which once switched lookup off)
    set_field(page, "speculation", "fixed")
    assert page.find_element("id", "k-label").is_displayed()
    set_field(page, "k", "4")
    before = answers(page)
    box = page.find_element("id", "prompt")
    box.send_keys("two", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "lines")  # Shift+Enter: a new line, nothing sent
    assert box.get_attribute("value") == "two\nlines" and answers(page) == before
    try:
        send(page, CODE)
        _coloured_answer(page, shots, before)
    finally:
        set_field(page, "speculation", "adaptive")


def _coloured_answer(page, shots, before):
    wait(lambda: answers(page) > before and len(last_answer(page).find_elements("css selector", ".body .tok")) > 12,
         what="streamed tokens")
    streaming = "streaming" in last_answer(page).get_attribute("class")
    page.save_screenshot(str(shots / "page-answer.png"))
    answer = finished(page, before + 1)
    assert streaming, "the answer had ended before the screenshot: it did not stream"
    assert answer.get_attribute("data-finish") == "length"  # every drafted token kept was shown
    assert answer.find_elements("css selector", ".body pre .tok")  # the code block, as code
    coloured = coloured_tokens(answer)
    accepted = int(answer.get_attribute("data-draft-accepted"))
    assert coloured["draft"] + coloured["ngram"] == accepted > 0, coloured
    assert coloured["ngram"] > 0 and coloured["draft"] > 0, coloured  # both drafters showed
    stats = answer.find_element("css selector", ".stats").text
    assert "tok/s" in stats and "tokens/round" in stats and f"({accepted}/" in stats
    assert answer.find_elements("css selector", "svg.chart rect.kept-ngram")
    assert answer.find_elements("css selector", "svg.chart line.k")
    legend = page.find_element("css selector", ".legend").text
    assert "draft model" in legend and "n-gram" in legend


def test_stop_cancels_and_frees_the_engine(page, server):
    page.find_element("id", "new-chat").click()
    assert not page.find_elements("css selector", ".msg")  # a new chat starts empty
    set_field(page, "max-tokens", "600")
    before = answers(page)
    send(page, "Count from 1 to 1000, separated by commas.")
    wait(lambda: answers(page) > before and len(last_answer(page).find_elements("css selector", ".body .tok")) > 5,
         what="tokens before stopping")
    page.find_element("id", "stop").click()
    answer = finished(page, before + 1)
    assert answer.get_attribute("data-finish") == "stopped"
    wait(lambda: not server.get("/health").json()["running"], 10, "the engine freed")
    assert page.find_element("id", "send").is_displayed()


def test_side_by_side_shows_both_speeds_and_identical_texts(page, shots):
    set_field(page, "max-tokens", "64")
    page.find_element("id", "new-chat").click()
    page.find_element("id", "side-by-side").click()
    try:
        send(page, TABLE)
        verdict = wait(lambda: (v := page.find_elements("css selector", ".verdict[data-same]")) and v[-1], 240,
                       "the side-by-side verdict")
        page.save_screenshot(str(shots / "page-side-by-side.png"))
        assert verdict.get_attribute("data-same") == "true", verdict.text
        assert "identical texts" in verdict.text and "tok/s off" in verdict.text and "tok/s on" in verdict.text
        off, on = page.find_elements("css selector", ".pair .msg.assistant")[-2:]
        # drafting off shows no drafted token; drafting on colours every draft it kept (whether any pays on this
        # machine is the policy's call: _coloured_answer asks for both colours on a prompt that repeats itself)
        assert coloured_tokens(off) == {"draft": 0, "ngram": 0}
        assert sum(coloured_tokens(on).values()) == int(on.get_attribute("data-draft-accepted")), coloured_tokens(on)
    finally:
        page.find_element("id", "side-by-side").click()


def test_structured_output_from_the_schema_box(page):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    set_field(page, "schema", json.dumps(schema))
    set_field(page, "max-tokens", "60")
    try:
        before = answers(page)
        send(page, "Name a city and its country, as JSON.")
        answer = finished(page, before + 1)
        value = json.loads(answer.find_element("css selector", ".body").text)
        assert set(value) == {"city", "country"}
    finally:
        set_field(page, "schema", "")


@pytest.mark.parametrize("field, value, message", [
    ("schema", '{"type": "nosuch"}', "nosuch"),
    ("schema", "{not json", "does not hold JSON"),
])
def test_errors_are_shown_on_the_page(page, field, value, message):
    old = js(page, "return document.getElementById(arguments[0]).value", field)
    set_field(page, field, value)
    try:
        errors = len(page.find_elements("css selector", ".msg.error"))
        send(page, "Hello")
        shown = wait(lambda: (e := page.find_elements("css selector", ".msg.error")) and len(e) > errors and e[-1],
                     30, "the error message")
        assert message in shown.text, shown.text
        assert page.find_element("id", "send").is_displayed()  # not left waiting
    finally:
        set_field(page, field, old)


def test_a_phone_width_screen(page, shots):
    page.set_window_size(390, 844)
    try:
        assert js(page, "return document.documentElement.scrollWidth") <= 390
        assert not page.find_element("id", "settings").is_displayed()  # behind the Settings button
        page.find_element("id", "toggle-settings").click()
        assert page.find_element("id", "settings").is_displayed()
        page.find_element("id", "toggle-settings").click()
        assert page.find_element("id", "prompt").is_displayed() and page.find_element("id", "send").is_displayed()
        page.save_screenshot(str(shots / "page-phone.png"))
    finally:
        page.set_window_size(1280, 900)
