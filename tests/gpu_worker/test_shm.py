"""Frames through shared memory: exact round trip, across processes, and no leaked segment."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kiln.gpu_worker.shm import FrameDescriptor, discard_frames, read_frames, write_frames

SHM_DIR = Path("/dev/shm")


def segment_exists(descriptor: FrameDescriptor) -> bool:
    return (SHM_DIR / descriptor.name).exists()


def test_round_trip_unlinks_the_segment() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (9, 24, 40, 3), dtype=np.uint8)
    descriptor = write_frames(frames)
    assert descriptor.shape == (9, 24, 40, 3)
    assert descriptor.nbytes == frames.nbytes
    assert segment_exists(descriptor)
    copy = read_frames(descriptor)
    assert np.array_equal(copy, frames)
    assert not segment_exists(descriptor)
    with pytest.raises(FileNotFoundError):
        read_frames(descriptor)  # read once


def test_non_contiguous_and_other_dtypes() -> None:
    floats = np.arange(60, dtype=np.float32).reshape(3, 4, 5)[:, ::2]
    assert np.array_equal(read_frames(write_frames(floats)), floats)
    empty = np.zeros((0, 8, 8, 3), np.uint8)
    assert read_frames(write_frames(empty)).shape == (0, 8, 8, 3)


def test_discard_is_idempotent() -> None:
    descriptor = write_frames(np.ones((2, 2, 3), np.uint8))
    discard_frames(descriptor)
    assert not segment_exists(descriptor)
    discard_frames(descriptor)


def test_a_segment_outlives_its_writer_and_nothing_leaks() -> None:
    # The writer exits before the reader looks: its resource tracker must neither unlink the
    # segment nor report it as leaked.
    script = textwrap.dedent(
        """
        import json, numpy as np
        from kiln.gpu_worker.shm import write_frames
        frames = np.arange(5 * 8 * 8 * 3, dtype=np.uint32).reshape(5, 8, 8, 3).astype(np.uint8)
        d = write_frames(frames)
        print(json.dumps({"name": d.name, "shape": d.shape, "dtype": d.dtype}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    fields = json.loads(done.stdout)
    descriptor = FrameDescriptor(fields["name"], tuple(fields["shape"]), fields["dtype"])
    assert "leaked" not in done.stderr, done.stderr
    expected = np.arange(5 * 8 * 8 * 3, dtype=np.uint32).reshape(5, 8, 8, 3).astype(np.uint8)
    assert np.array_equal(read_frames(descriptor), expected)
    assert not segment_exists(descriptor)
