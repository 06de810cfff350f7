"""The ledger's arithmetic (kiln/common/ledger.py), a usage range's ends (contract/usage.py)."""

from __future__ import annotations

import math

import pytest

from kiln.common.ledger import shares, work_units
from kiln.tasks.contract.usage import MAX_RANGE_S, parse_instant, usage_range

NOW = 1_800_000_000.0


def test_a_batch_is_shared_by_outputs_pixels_and_frames() -> None:
    works = {
        "one-image": work_units(1, 64, 64, 1),
        "two-images": work_units(2, 64, 64, 1),
        "a-video": work_units(1, 64, 64, 5),
    }
    parts = shares(16.0, works)  # 8 seconds on 2 devices
    assert parts["one-image"] == pytest.approx(2.0)
    assert parts["two-images"] == pytest.approx(4.0)
    assert parts["a-video"] == pytest.approx(10.0)
    assert math.fsum(parts.values()) == 16.0  # the rounding's remainder goes to the last one


def test_a_request_alone_is_charged_the_whole_forward_and_an_empty_batch_nothing() -> None:
    assert shares(3.5, {"alone": work_units(4, 512, 512, 1)}) == {"alone": 3.5}
    assert shares(3.5, {}) == {}
    assert shares(1.0, {"a": 0, "b": 0}) == {"a": 0.5, "b": 0.5}  # no work stated: even


def test_many_uneven_shares_add_up_exactly() -> None:
    works = {f"r{i}": work_units(1 + i % 3, 64 + i, 48, 1 + i % 7) for i in range(37)}
    assert math.fsum(shares(123.456789, works).values()) == pytest.approx(123.456789, abs=1e-12)


def test_instants_are_epoch_seconds_iso_times_or_durations_back() -> None:
    assert parse_instant("1700000000.5", NOW) == 1700000000.5
    assert parse_instant("24h", NOW) == NOW - 86400
    assert parse_instant("90s", NOW) == NOW - 90
    assert parse_instant("2027-01-15T00:00:00Z", NOW) == 1799971200.0
    assert parse_instant("2027-01-15T00:00:00", NOW) == 1799971200.0  # no zone: UTC


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("nan", "finite"),
        ("inf", "finite"),
        ("-5", "out of range"),
        ("1e300", "out of range"),
        ("9" * 400, "finite"),
        ("yesterday", "not epoch seconds"),
        ("24y", "not epoch seconds"),
        ("999999999d", "out of range"),  # a duration back before 1970
    ],
)
def test_a_hostile_instant_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_instant(text, NOW)


def test_a_range_names_its_bad_end() -> None:
    assert usage_range(None, None, NOW) == (NOW - 86400, NOW)
    with pytest.raises(ValueError, match=r"^since: .* is not before until"):
        usage_range("1h", "2h", NOW)
    with pytest.raises(ValueError, match=r"^until: "):
        usage_range("1h", "nan", NOW)
    with pytest.raises(ValueError, match=r"^since: the range is longer"):
        usage_range(str(NOW - MAX_RANGE_S - 1), None, NOW)
