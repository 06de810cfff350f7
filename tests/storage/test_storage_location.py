"""Outputs have one absolute home: the default folder, relative URLs refused, secrets masked."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.storage.settings import StorageSettings, masked_url


def test_the_default_store_is_outputs_under_kiln_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KILN_STORAGE_URL", raising=False)
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    assert StorageSettings().storage_url == f"file://{tmp_path / 'home' / 'outputs'}"


def test_without_kiln_home_the_default_is_under_the_data_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("KILN_STORAGE_URL", "KILN_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert StorageSettings().storage_url == f"file://{tmp_path / 'data' / 'kiln' / 'outputs'}"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    expected = tmp_path / "user" / ".local" / "share" / "kiln" / "outputs"
    assert StorageSettings().storage_url == f"file://{expected}"


def test_the_default_does_not_depend_on_the_working_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KILN_STORAGE_URL", raising=False)
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    urls = set()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        urls.add(StorageSettings().storage_url)
    assert len(urls) == 1


@pytest.mark.parametrize("url", ["file://./kiln-outputs", "file://outputs", "file://localhost/"])
def test_a_relative_file_url_is_refused_naming_the_setting(url: str) -> None:
    if url == "file://localhost/":  # `localhost/` then an absolute path is fine
        assert StorageSettings(storage_url=url).storage_url == "file:///"
        return
    with pytest.raises(ValidationError, match="is relative: use file:///absolute/path") as info:
        StorageSettings(storage_url=url)
    assert info.value.errors()[0]["loc"] == ("storage_url",)


def test_a_relative_kiln_home_is_refused() -> None:
    with pytest.raises(ValidationError, match="must be an absolute path"):
        StorageSettings(home=Path("here"))


def test_the_start_line_masks_the_redis_password() -> None:
    settings = StorageSettings(
        redis_url="redis://user:hunter2@db:6380/1",
        redis_namespace="ns",
        storage_url="file:///srv/kiln",
    )
    assert settings.describe() == (
        "redis redis://user:***@db:6380/1, namespace ns, storage file:///srv/kiln"
    )
    assert masked_url("redis://:hunter2@db:6380/0") == "redis://:***@db:6380/0"
    assert masked_url("redis://db:6380/0") == "redis://db:6380/0"
