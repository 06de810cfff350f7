"""List pages and odd paths against the real API: refusals that name what is wrong, no redirects."""

from __future__ import annotations

import httpx
import pytest

from tests.tasks.helpers import Api


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/batches"])
def test_a_page_over_the_maximum_is_refused_naming_limit(api: Api, path: str) -> None:
    maximum = api.settings.list_limit_max
    assert httpx.get(api.url + path, params={"limit": maximum}, headers=api.auth()).is_success
    refused = httpx.get(api.url + path, params={"limit": maximum + 1}, headers=api.auth())
    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["query", "limit"]
    assert error["ctx"] == {"le": maximum}
    assert str(maximum) in error["msg"]


def test_the_owner_filter_is_for_admin_keys_even_naming_oneself(api: Api) -> None:
    own = {"owner": api.key_ids["alice"]}
    refused = httpx.get(f"{api.url}/v1/jobs", params=own, headers=api.auth())
    assert refused.status_code == 403
    assert "owner" in refused.json()["detail"]
    assert httpx.get(f"{api.url}/v1/jobs", params=own, headers=api.auth("admin")).is_success


@pytest.mark.parametrize("path", ["/v1/batches/..%2f", "/v1/jobs/..%2f", "/v1/batches/"])
def test_a_path_with_a_trailing_slash_is_a_404_not_a_redirect(api: Api, path: str) -> None:
    got = httpx.get(api.url + path, headers=api.auth(), follow_redirects=False)
    assert got.status_code == 404
    assert "location" not in got.headers
