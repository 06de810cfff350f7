"""The preemption-notice watcher against a local fake metadata server (tests/fake_metadata.py).

AWS's spot `instance-action` (404, then its JSON document; IMDSv2 token required) and GCE's
`preempted` flag (`FALSE`/`TRUE` with `Metadata-Flavor: Google`). A watcher polls until the
notice comes, calls its drain once, and stops; an endpoint that does not answer, or answers
something else, is no notice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kiln.tasks.node.preemption import PreemptionNotice, PreemptionWatcher, read_notice
from tests.fake_metadata import AWS_PATH, GCE_PATH, FakeMetadata
from tests.waiting import GENEROUS_S, wait_until


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    yield fake
    fake.close()


def test_aws_no_notice_is_a_404_then_the_instance_action_document(metadata: FakeMetadata) -> None:
    url = metadata.base + AWS_PATH
    assert read_notice(url, "aws") is None
    metadata.notice = True
    assert read_notice(url, "aws") == PreemptionNotice("terminate", "2026-12-06T22:10:00Z")


def test_gce_preempted_flag_is_read_with_its_header(metadata: FakeMetadata) -> None:
    url = metadata.base + GCE_PATH
    assert read_notice(url, "gce") is None
    metadata.notice = True
    assert read_notice(url, "gce") == PreemptionNotice("preempted")


def test_an_answer_it_cannot_read_or_no_answer_is_no_notice(metadata: FakeMetadata) -> None:
    metadata.notice = True
    metadata.aws_body = b"<html>captive portal</html>"
    assert read_notice(metadata.base + AWS_PATH, "aws") is None
    metadata.aws_body = b'{"unexpected": 1}'
    assert read_notice(metadata.base + AWS_PATH, "aws") is None
    assert read_notice(metadata.base + "/elsewhere", "gce") is None  # 404 on GCE: an error
    metadata.close()
    assert read_notice(metadata.base + AWS_PATH, "aws") is None  # nothing listens


@pytest.mark.parametrize(("kind", "path"), [("aws", AWS_PATH), ("gce", GCE_PATH)])
def test_the_watcher_polls_until_the_notice_then_drains_once(
    metadata: FakeMetadata, kind: str, path: str
) -> None:
    drained: list[PreemptionNotice] = []
    done = threading.Event()

    def drain(notice: PreemptionNotice) -> None:
        drained.append(notice)
        done.set()

    watcher = PreemptionWatcher(metadata.base + path, kind, 0.05, drain)  # type: ignore[arg-type]
    watcher.start()
    try:
        # it polls and, with no notice, does nothing
        wait_until(lambda: metadata.polls, lambda polls: polls >= 3, what="three polls")
        assert drained == []
        metadata.notice = True
        assert done.wait(GENEROUS_S)
        polls = metadata.polls
        threading.Event().wait(0.3)
        assert len(drained) == 1  # one drain: the node is going
        assert metadata.polls == polls  # and it stopped polling
    finally:
        watcher.stop()
