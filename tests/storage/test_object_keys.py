"""output_key is the only key builder and refuses anything that could escape the prefix."""

from __future__ import annotations

import pytest

from kiln.storage.errors import InvalidObjectKey
from kiln.storage.objects import check_key, new_attempt_name, output_key

ATTEMPT = "7-0123abcd"


def test_output_key_shape() -> None:
    assert (
        output_key("outputs/2026", "job-1", 0, "png", attempt=ATTEMPT)
        == "outputs/2026/job-1/7-0123abcd/0.png"
    )
    assert output_key("", "job_1", 12, "mp4", attempt=ATTEMPT) == "job_1/7-0123abcd/12.mp4"


def test_every_attempt_names_a_folder_of_its_own() -> None:
    names = {new_attempt_name(3) for _ in range(50)}
    assert len(names) == 50  # the same lease token twice still gives two folders
    assert all(name.startswith("3-") for name in names)
    for name in names:
        output_key("outputs", "job", 0, "png", attempt=name)  # each a valid folder


@pytest.mark.parametrize(
    "attempt",
    ["", "..", "7", "7-0123ABCD", "7-0123abc", "7-0123abcd/..", "x-0123abcd", "7-0123abcd\n"],
)
def test_output_key_refuses_odd_attempt_names(attempt: str) -> None:
    with pytest.raises(InvalidObjectKey):
        output_key("outputs", "job", 0, "png", attempt=attempt)


@pytest.mark.parametrize("token", [-1, True, "3"])
def test_attempt_names_need_a_lease_token(token: object) -> None:
    with pytest.raises(InvalidObjectKey):
        new_attempt_name(token)  # type: ignore[arg-type]


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
        output_key(prefix, job_id, index, ext, attempt=ATTEMPT)


@pytest.mark.parametrize(
    "key", ["other/job/0.png", "outputs/../x/0.png", "/outputs/job/0.png", "outputs", ""]
)
def test_store_keys_must_lie_under_the_prefix(key: str) -> None:
    with pytest.raises(InvalidObjectKey):
        check_key("outputs", key)
