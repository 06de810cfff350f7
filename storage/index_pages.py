"""Cursor paging over a sorted-set index, newest first: the one loop job and batch listings share.

An index maps ids to a creation sequence (the score). A page reads up to `limit` members below the
cursor, fetches their records, drops members whose record is gone (expired) from the index, and
keeps those the caller's filter takes. A call reads at most `MAX_SCAN_ROUNDS` pages, so a rare
filter cannot make it scan a whole index: a page may then be short while a cursor still comes
back; None means there is nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import redis

MAX_SCAN_ROUNDS = 8

Record = TypeVar("Record")


def parse_cursor(cursor: str | None) -> str:
    """The index bound a cursor stands for (`+inf` for the first page); ValueError if malformed."""
    if cursor is None:
        return "+inf"
    if not (cursor.isascii() and cursor.isdigit()):
        raise ValueError(f"invalid cursor {cursor!r}")
    return f"({cursor}"


def newest_first(
    client: redis.Redis[str],
    index: str,
    cursor: str | None,
    limit: int,
    read: Callable[[list[str]], Sequence[Record | None]],
    keep: Callable[[Record], bool] = lambda _record: True,
) -> tuple[list[Record], str | None]:
    """Up to `limit` records of `index` below `cursor` that `keep` takes, and the next cursor."""
    upper = parse_cursor(cursor)
    found: list[Record] = []
    for _ in range(MAX_SCAN_ROUNDS):
        page = client.zrevrangebyscore(index, upper, "-inf", 0, limit, withscores=True)
        records = read([member for member, _ in page])
        gone = [member for (member, _), record in zip(page, records, strict=True) if record is None]
        if gone:
            client.zrem(index, *gone)
        for (_, score), record in zip(page, records, strict=True):
            if record is not None and keep(record):
                found.append(record)
                if len(found) == limit:
                    return found, str(int(score))
        if len(page) < limit:
            return found, None
        upper = f"({int(page[-1][1])}"
    return found, upper[1:]
