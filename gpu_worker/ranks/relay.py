"""Small objects between ranks over a gloo CPU group, one collective each on the fast path.

torch's `broadcast_object_list` and `gather_object` take two collectives per call (sizes, then
bytes). A request batch is relayed in one fixed-size broadcast (a second one only when the
pickled command is larger than the buffer), and per-forward outcomes travel as one all-gather of
a few numbers, with a second exchange for the failure texts only when some rank failed.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from kiln.gpu_worker.protocol import FailureKind, RankOutcome

RELAY_BYTES = 8192
_HEADER = 8  # payload length, little-endian
_STATUSES = ("ok", "stopped", "failed")
_KINDS = (None, *FailureKind)


def broadcast_command(command: Any, group: dist.ProcessGroup) -> None:
    """Rank 0: send a picklable command to every rank of `group`."""
    payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
    buffer = torch.zeros(RELAY_BYTES, dtype=torch.uint8)
    buffer[:_HEADER] = _as_tensor(len(payload).to_bytes(_HEADER, "little"))
    inline = payload[: RELAY_BYTES - _HEADER]
    buffer[_HEADER : _HEADER + len(inline)] = _as_tensor(inline)
    dist.broadcast(buffer, src=0, group=group)
    if len(payload) > len(inline):
        dist.broadcast(_as_tensor(payload[len(inline) :]), src=0, group=group)


def receive_command(group: dist.ProcessGroup) -> Any:
    """Other ranks: block until rank 0 broadcasts a command, and return it."""
    buffer = torch.empty(RELAY_BYTES, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    raw = buffer.numpy().tobytes()
    length = int.from_bytes(raw[:_HEADER], "little")
    payload = raw[_HEADER : _HEADER + length]
    if length > len(payload):
        rest = torch.empty(length - len(payload), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)


def exchange_outcomes(
    outcome: RankOutcome, world_size: int, group: dist.ProcessGroup | None
) -> list[RankOutcome]:
    """Every rank's outcome, on every rank (rank order); raises if a collective breaks."""
    if group is None:
        return [outcome]
    mine = torch.tensor(
        [
            _STATUSES.index(outcome.status),
            _KINDS.index(outcome.kind),
            outcome.steps_run,
            outcome.peak_memory_mb,
            outcome.wake_s,
        ],
        dtype=torch.float64,
    )
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine, group=group)
    messages = [""] * world_size
    if any(int(part[0]) == _STATUSES.index("failed") for part in parts):
        # Rare path: every rank knows someone failed, so all join this second exchange.
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, outcome.message, group=group)
        messages = [str(text) for text in gathered]
    return [
        RankOutcome(
            rank=rank,
            status=_STATUSES[int(part[0])],
            kind=_KINDS[int(part[1])],
            message=messages[rank],
            steps_run=int(part[2]),
            peak_memory_mb=float(part[3]),
            wake_s=float(part[4]),
        )
        for rank, part in enumerate(parts)
    ]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
