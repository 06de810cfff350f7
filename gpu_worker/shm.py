"""Frames from rank 0 to the coordinator through POSIX shared memory, never pickled.

The writer copies an array into a new segment and sends only a small frozen `FrameDescriptor`
(name, shape, dtype). The reader copies the pixels out and unlinks the segment, so each segment
lives exactly from `write_frames` to `read_frames` (or `discard_frames` when nobody will read it).

Ownership of the segment passes with the descriptor: the writer unregisters the segment from its
resource tracker at once, otherwise the tracker would unlink it (and warn about a "leak") when the
writing process exits, possibly before the reader got to it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

SEGMENT_PREFIX = "kiln_"


@dataclass(frozen=True)
class FrameDescriptor:
    """Where one array lies in shared memory: segment name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Size of the array in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def write_frames(frames: np.ndarray) -> FrameDescriptor:
    """Copy `frames` into a new shared-memory segment; the reader owns (and unlinks) it."""
    array = np.ascontiguousarray(frames)
    name = f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:20]}"
    # A segment cannot be empty; one spare byte keeps zero-size arrays working.
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(array.nbytes, 1))
    try:
        target: np.ndarray = np.ndarray(array.shape, dtype=array.dtype, buffer=segment.buf)
        target[...] = array
        del target  # release the exported buffer before close()
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return FrameDescriptor(name=name, shape=tuple(array.shape), dtype=array.dtype.str)


def read_frames(descriptor: FrameDescriptor) -> np.ndarray:
    """Copy the array out of its segment and unlink the segment; works once per descriptor."""
    segment = shared_memory.SharedMemory(name=descriptor.name)
    try:
        view: np.ndarray = np.ndarray(
            descriptor.shape, dtype=np.dtype(descriptor.dtype), buffer=segment.buf
        )
        frames = view.copy()
        del view
    finally:
        segment.close()
        segment.unlink()
    return frames


def discard_frames(descriptor: FrameDescriptor) -> None:
    """Unlink a segment nobody will read (its request failed or was dropped); idempotent."""
    try:
        segment = shared_memory.SharedMemory(name=descriptor.name)
    except FileNotFoundError:
        return
    segment.close()
    segment.unlink()
