"""output_key is the only key builder and refuses anything that could escape the prefix."""

from __future__ import annotations

import pytest

from kiln.storage.errors import InvalidObjectKey
from kiln.storage.objects import check_key, output_key


def test_output_key_shape() -> None:
    assert output_key("outputs/2026", "job-1", 0, "png") == "outputs/2026/job-1/0.png"
    assert output_key("", "job_1", 12, "mp4") == "job_1/12.mp4"


@pytest.mark.parametrize(
    ("prefix", "job_id", "index", "ext"),
    [
        ("outputs", "..", 0, "png"),
        ("outputs", "../other", 0, "png"),
        ("outputs", "a/b", 0, "png"),
        ("outputs", "", 0, "png"),
        ("outputs", ".hidden", 0, "png"),
        ("outputs", "a\x00b", 0, "png"),
        ("outputs", "job", -1, "png"),
        ("outputs", "job", True, "png"),
        ("outputs", "job", 0, "../png"),
        ("outputs", "job", 0, "p/ng"),
        ("outputs", "job", 0, ""),
        ("outputs", "job", 0, "png\n"),
        ("/etc", "job", 0, "png"),
        ("outputs/../x", "job", 0, "png"),
        ("outputs/", "job", 0, "png"),
        ("outputs//x", "job", 0, "png"),
    ],
)
def test_output_key_refuses_escapes(prefix: str, job_id: str, index: int, ext: str) -> None:
    with pytest.raises(InvalidObjectKey):
        output_key(prefix, job_id, index, ext)


@pytest.mark.parametrize(
    "key", ["other/job/0.png", "outputs/../x/0.png", "/outputs/job/0.png", "outputs", ""]
)
def test_store_keys_must_lie_under_the_prefix(key: str) -> None:
    with pytest.raises(InvalidObjectKey):
        check_key("outputs", key)
