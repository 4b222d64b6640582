"""The status page in a real headless Chromium (Debian's chromium + chromium-driver, via selenium):
it renders every backend live from the admin JSON, shows refusals by reason and follows a drain,
and works offline (nothing loaded from anywhere else). The test saves a screenshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from gateway.state.keys import hash_key, new_key
from support import ROOT, GatewayServer, Sim, free_port, gateway_config, wait_until

MODEL = "test-model"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("GATEWAY_TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver (scripts/test installs them as root)")]


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--no-proxy-server", "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_status_page_shows_backends_refusals_and_a_drain_live(keys, browser):
    from selenium.webdriver.common.by import By

    admin_key = new_key()
    with Sim(MODEL, api_key="s") as a, Sim(MODEL, api_key="s") as b:
        backends = [{"url": a.url, "api_key": "s", "name": "sim-a"}, {"url": b.url, "api_key": "s", "name": "sim-b"}]
        with GatewayServer(gateway_config(keys, backends, admin={"port": free_port(), "key_hash": hash_key(admin_key)})) as gw:
            wait_until(lambda: all(x.healthy for x in gw.gateway.pool), 20, 0.02, "both sims healthy")
            admin_url = f"http://127.0.0.1:{gw.gateway.admin_server.port}"
            with httpx.Client(base_url=gw.url, timeout=20) as c:
                for _ in range(8):
                    c.post("/v1/chat/completions", headers={"authorization": f"Bearer {keys.alice}"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
                for _ in range(3):
                    c.post("/v1/chat/completions", headers={"authorization": "Bearer sk-wrong"}, json={})
                c.get("/v1/chat%2Fcompletions")  # refused before it matches a route: counted all the same

            page = httpx.get(admin_url + "/status")
            assert page.status_code == 200 and b"://" not in page.content  # no CDN, nothing fetched from elsewhere

            browser.get(f"{admin_url}/status#key={admin_key}")
            polls = lambda: int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0)  # noqa: E731
            wait_until(lambda: polls() >= 1, 20, 0.1, "the first poll to render")
            assert "key=" not in browser.current_url  # the key leaves the address bar at once

            rows = {r.get_attribute("data-backend"): r for r in browser.find_elements(By.CSS_SELECTOR, "#backends tbody tr")}
            assert set(rows) == {"sim-a", "sim-b"}
            for row in rows.values():
                cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
                assert cells[1] == "healthy" and row.get_attribute("class") == "ok"
            served = sum(int(r.find_elements(By.TAG_NAME, "td")[4].text) for r in rows.values())
            assert served == 8
            reasons = browser.find_element(By.ID, "reasons").text
            assert "invalid_api_key\n3" in reasons or "invalid_api_key 3" in reasons, reasons
            assert "path_not_canonical" in reasons
            assert browser.find_element(By.ID, "total").text.startswith("12")
            assert browser.find_elements(By.CSS_SELECTOR, "#rate-spark polyline")

            # Live: a drain through the admin API shows on the next poll, without reloading the page.
            before = polls()
            httpx.post(admin_url + "/admin/backends/sim-a/drain", headers={"authorization": f"Bearer {admin_key}"}).raise_for_status()
            wait_until(lambda: polls() > before + 1, 20, 0.1, "two more polls")
            row = browser.find_element(By.CSS_SELECTOR, '#backends tr[data-backend="sim-a"]')
            assert row.get_attribute("class") == "drain" and "draining" in row.text
            assert "1/2 backends available" in browser.find_element(By.ID, "meta").text

            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "status_page.png"
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_status_page_without_the_key_asks_for_it(keys, browser):
    from selenium.webdriver.common.by import By

    with Sim(MODEL) as a:
        cfg = gateway_config(keys, [{"url": a.url}], admin={"port": free_port(), "key_hash": hash_key(new_key())})
        with GatewayServer(cfg) as gw:
            browser.execute_script("sessionStorage.clear()") if browser.current_url.startswith("http") else None
            browser.get(f"http://127.0.0.1:{gw.gateway.admin_server.port}/status")
            browser.execute_script("sessionStorage.clear()")
            browser.refresh()
            wait_until(lambda: browser.find_element(By.ID, "key-box").is_displayed(), 20, 0.1, "the key form")
            assert "admin key is missing or wrong" in browser.find_element(By.ID, "error").text
            assert browser.find_element(By.CSS_SELECTOR, "#backends tbody").text == "waiting for the first poll"
