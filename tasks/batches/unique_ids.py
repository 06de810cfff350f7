"""The custom_ids of a batch file, checked for repeats in memory that does not grow with the file.

A million-line file cannot keep a set of its ids in the API (tens of MB per upload), so each id
goes two ways as the file streams past: its 64-bit hash into one of `BUCKETS` small buffers (by
6 bits of the hash), spilled to a temporary file as they fill, and the id itself, with its line
number, into a second temporary file. At the end each bucket's hashes are checked on their own;
a bucket of more than `CHECK_AT` hashes is first spread again over `BUCKETS` buckets of its own
(by the hash's next 6 bits, through a temporary file of their own), so no check ever holds more
than `CHECK_AT` hashes, however long the file. Only when some hash repeats is the id file read
again to find the exact repeats, so a collision of two different ids' hashes never refuses a
valid file. The memory used then grows with the repeated ids only.

Spilled runs of one bucket are chained in the file (each run's header gives the offset of the
bucket's run before it), so the index of the runs is a few numbers per bucket, not one per run.

Hashes are Python's own string hash: random per process, stable within it, which is all one
intake needs (nothing outlives it).
"""

from __future__ import annotations

import struct
import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

BITS = 6
BUCKETS = 1 << BITS
# hashes a bucket holds before they go to the spill file: BUCKETS x 2 KiB in memory at most
SPILL_AT = 256
# most hashes checked at once (a set of them: about 256 KiB); a larger bucket is spread again
CHECK_AT = 4096
_MASK = (1 << 64) - 1
_FILE_BUFFER = 64 * 1024
_RUN_HEADER = struct.Struct("<qq")  # the offset of the bucket's run before (-1: none), hashes


@dataclass(frozen=True)
class Repeat:
    """A line whose custom_id an earlier line already used."""

    line: int
    custom_id: str
    first_line: int
    valid: bool  # the line passed every other check (else it is refused for those already)


class CustomIds:
    """Records (line, custom_id, valid) as a file streams; `repeats` at the end; then `close`."""

    def __init__(
        self,
        hash_of: Callable[[str], int] = hash,
        spill_at: int = SPILL_AT,
        check_at: int = CHECK_AT,
    ) -> None:
        self._hash_of = hash_of  # another only to test collisions
        self._ids: IO[bytes] | None = None  # "line valid custom_id" per line, opened on first use
        self._hashes = _Buckets(0, spill_at, check_at)

    def add(self, line: int, custom_id: str, valid: bool) -> None:
        """Record one line's custom_id (`valid`: whether the rest of the line passed)."""
        self._hashes.add(self._hash_of(custom_id) & _MASK)
        if self._ids is None:
            self._ids = tempfile.TemporaryFile(buffering=_FILE_BUFFER)  # noqa: SIM115 (close)
        self._ids.write(b"%d %d %s\n" % (line, valid, custom_id.encode()))

    def repeats(self) -> Iterator[Repeat]:
        """Every line whose custom_id an earlier line used, in line order."""
        repeated = self._hashes.repeated()
        if repeated and self._ids is not None:
            yield from self._exact(repeated, self._ids)

    def close(self) -> None:
        """Remove the temporary files."""
        self._hashes.close()
        if self._ids is not None:
            self._ids.close()
        self._ids = None

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


class _Buckets:
    """Hashes spread over `BUCKETS` by the `BITS` bits from `shift` on, spilled as they fill."""

    def __init__(self, shift: int, spill_at: int, check_at: int) -> None:
        self.shift = shift
        self._spill_at = spill_at
        self._check_at = check_at
        self._file: IO[bytes] | None = None
        self._buffers = [array("Q") for _ in range(BUCKETS)]
        self._last = [-1] * BUCKETS  # the offset of each bucket's last spilled run
        self._counts = [0] * BUCKETS  # hashes spilled per bucket

    def add(self, digest: int) -> None:
        """Put one hash in its bucket."""
        bucket = (digest >> self.shift) & (BUCKETS - 1)
        buffer = self._buffers[bucket]
        buffer.append(digest)
        if len(buffer) >= self._spill_at:
            self._spill(bucket)

    def repeated(self) -> set[int]:
        """The hashes added more than once (reading every bucket back, one at a time)."""
        for bucket in range(BUCKETS):
            self._spill(bucket)
        found: set[int] = set()
        for bucket in range(BUCKETS):
            if self._counts[bucket] <= self._check_at:
                hashes = array("Q")
                for run in self._runs(bucket):
                    hashes.extend(run)
                found |= _repeated(hashes)
            elif self.shift + BITS >= 64:  # every bit is spent: what is left is repeats
                found |= _repeated_streamed(self._runs(bucket))
            else:
                found |= self._spread(bucket)
        return found

    def close(self) -> None:
        """Remove the spill file."""
        if self._file is not None:
            self._file.close()
        self._file = None

    def _spread(self, bucket: int) -> set[int]:
        """The repeats of a bucket too large to check at once: spread by the next bits first."""
        finer = _Buckets(self.shift + BITS, self._spill_at, self._check_at)
        try:
            for run in self._runs(bucket):
                for digest in run:
                    finer.add(digest)
            return finer.repeated()
        finally:
            finer.close()

    def _spill(self, bucket: int) -> None:
        buffer = self._buffers[bucket]
        if not buffer:
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(buffering=_FILE_BUFFER)  # noqa: SIM115 (close)
        spill = self._file
        offset = spill.seek(0, 2)  # runs go at the end (reading one back moves the position)
        spill.write(_RUN_HEADER.pack(self._last[bucket], len(buffer)))
        spill.write(buffer.tobytes())
        self._last[bucket] = offset
        self._counts[bucket] += len(buffer)
        self._buffers[bucket] = array("Q")

    def _runs(self, bucket: int) -> Iterator[array[int]]:
        """The bucket's spilled runs, last first."""
        offset = self._last[bucket]
        while offset >= 0:
            assert self._file is not None
            self._file.seek(offset)
            offset, count = _RUN_HEADER.unpack(self._file.read(_RUN_HEADER.size))
            run = array("Q")
            run.frombytes(self._file.read(count * run.itemsize))
            yield run


def _repeated(hashes: array[int]) -> set[int]:
    """The hashes that occur more than once (the common case, none, without counting)."""
    if len(set(hashes)) == len(hashes):
        return set()
    return {digest for digest, count in Counter(hashes).items() if count > 1}


def _repeated_streamed(runs: Iterator[array[int]]) -> set[int]:
    """`_repeated` of hashes too many to hold but of few values: counted as they are read."""
    seen: set[int] = set()
    repeated: set[int] = set()
    for run in runs:
        for digest in run:
            if digest in seen:
                repeated.add(digest)
            else:
                seen.add(digest)
    return repeated
