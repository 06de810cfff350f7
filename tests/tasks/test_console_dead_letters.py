"""The console's dead-letter list in a real browser (headless Chromium) against a real API."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.e2e.test_console import CHROMEDRIVER, CHROMIUM, enter_key, wait_for
from tests.e2e.test_console import browser as browser  # the fixture: headless Chromium
from tests.tasks.helpers import Api
from tests.tasks.test_dead_letter_routes import dead_jobs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="no headless Chromium here (.ci/ensure-chromium installs it with apt-get)",
    ),
]


def test_the_console_lists_the_keys_dead_letters(api: Api, browser: WebDriver) -> None:
    mine = dead_jobs(api, 2)
    dead_jobs(api, 1, key="bob")  # another key's: not on alice's page
    browser.get(f"{api.url}/console/")
    enter_key(browser, api.keys["alice"])

    def rows(driver: WebDriver) -> list[str] | None:
        found = driver.find_elements(By.CSS_SELECTOR, "#dead-body tr")
        ids = [row.get_attribute("data-id") or "" for row in found]
        return ids if len(ids) == 2 else None

    listed = wait_for(browser, "the dead-letter list", rows)
    assert listed == mine[::-1]
    text = browser.find_element(By.ID, "dead-body").text
    assert "WorkerGroupDied" in text
    assert "poison: group_broken_twice" in text
