"""The custom_ids of a batch file, checked for repeats without memory that grows with the file.

A million-line file cannot keep a set of its ids in the API (tens of MB per upload), so each id
goes two ways as the file streams past: its 64-bit hash into one of `BUCKETS` small buffers,
spilled to a temporary file as they fill, and the id itself, with its line number, into a second
temporary file. At the end each bucket's hashes are checked on their own (a set of 1/`BUCKETS` of
the file's ids at a time); only when some hash repeats is the id file read again to find the exact
repeats, so a collision of two different ids' hashes never refuses a valid file. The memory used
then grows with the repeated ids only.

Hashes are Python's own string hash: random per process, stable within it, which is all one
intake needs (nothing outlives it).
"""

from __future__ import annotations

import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

BUCKETS = 64
# hashes a bucket holds before they go to the spill file: BUCKETS x 8 KiB in memory at most
SPILL_AT = 1024
_MASK = (1 << 64) - 1
_FILE_BUFFER = 64 * 1024


@dataclass(frozen=True)
class Repeat:
    """A line whose custom_id an earlier line already used."""

    line: int
    custom_id: str
    first_line: int
    valid: bool  # the line passed every other check (else it is refused for those already)


class CustomIds:
    """Records (line, custom_id, valid) as a file streams; `repeats` at the end; then `close`."""

    def __init__(self, hash_of: Callable[[str], int] = hash, spill_at: int = SPILL_AT) -> None:
        self._hash_of = hash_of  # another only to test collisions
        self._spill_at = spill_at
        self._ids: IO[bytes] | None = None  # "line valid custom_id" per line, opened on first use
        self._hashes: IO[bytes] | None = None
        self._buffers = [array("Q") for _ in range(BUCKETS)]
        self._runs: list[list[tuple[int, int]]] = [[] for _ in range(BUCKETS)]  # (offset, bytes)

    def add(self, line: int, custom_id: str, valid: bool) -> None:
        """Record one line's custom_id (`valid`: whether the rest of the line passed)."""
        digest = self._hash_of(custom_id) & _MASK
        bucket = digest % BUCKETS
        buffer = self._buffers[bucket]
        buffer.append(digest)
        if len(buffer) >= self._spill_at:
            self._spill(bucket)
        if self._ids is None:
            self._ids = tempfile.TemporaryFile(buffering=_FILE_BUFFER)  # noqa: SIM115 (close)
        self._ids.write(b"%d %d %s\n" % (line, valid, custom_id.encode()))

    def repeats(self) -> Iterator[Repeat]:
        """Every line whose custom_id an earlier line used, in line order."""
        repeated: set[int] = set()
        for bucket in range(BUCKETS):
            repeated |= _repeated(self._bucket(bucket))
        if repeated and self._ids is not None:
            yield from self._exact(repeated, self._ids)

    def close(self) -> None:
        """Remove the temporary files."""
        for spill in (self._ids, self._hashes):
            if spill is not None:
                spill.close()
        self._ids = self._hashes = None

    def _spill(self, bucket: int) -> None:
        if self._hashes is None:
            self._hashes = tempfile.TemporaryFile(buffering=_FILE_BUFFER)  # noqa: SIM115
        data = self._buffers[bucket].tobytes()
        self._runs[bucket].append((self._hashes.tell(), len(data)))
        self._hashes.write(data)
        self._buffers[bucket] = array("Q")

    def _bucket(self, bucket: int) -> array[int]:
        hashes = array("Q")
        if self._hashes is not None and self._runs[bucket]:
            self._hashes.flush()
            for offset, size in self._runs[bucket]:
                self._hashes.seek(offset)
                hashes.frombytes(self._hashes.read(size))
            self._hashes.seek(0, 2)  # back to the end, should more be spilled
        hashes.extend(self._buffers[bucket])
        return hashes

    def _exact(self, repeated: set[int], ids: IO[bytes]) -> Iterator[Repeat]:
        ids.flush()
        ids.seek(0)
        first: dict[str, int] = {}  # only ids whose hash repeats
        for raw in ids:
            number, valid, name = raw.rstrip(b"\n").split(b" ", 2)
            custom_id = name.decode()
            if self._hash_of(custom_id) & _MASK not in repeated:
                continue
            line = int(number)
            if custom_id in first:
                yield Repeat(line, custom_id, first[custom_id], valid == b"1")
            else:
                first[custom_id] = line


def _repeated(hashes: array[int]) -> set[int]:
    """The hashes that occur more than once (the common case, none, without counting)."""
    if len(set(hashes)) == len(hashes):
        return set()
    return {digest for digest, count in Counter(hashes).items() if count > 1}
