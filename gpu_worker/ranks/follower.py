"""What the ranks other than 0 (the followers) do.

They sleep in the relay broadcast, run what rank 0 sends, and take rank 0's stop decision after
every step.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from kiln.gpu_worker.protocol import RunBatch, ShutdownGroup
from kiln.gpu_worker.ranks.forward import StepSync, forward_batch
from kiln.gpu_worker.ranks.relay import exchange_outcomes, receive_command
from kiln.gpu_worker.ranks.start import RankRuntime


def follow(runtime: RankRuntime, status: Connection) -> None:
    """Serve rank 0's batches until it relays a shutdown; raises if a collective breaks."""
    args = runtime.args
    while True:
        assert runtime.idle_group is not None  # a follower implies world_size > 1
        command = receive_command(runtime.idle_group)
        if isinstance(command, ShutdownGroup):
            return
        if not isinstance(command, RunBatch):
            raise RuntimeError(f"rank {args.rank}: unexpected relay {command!r}")
        sync = StepSync(command, runtime.control_group, None)
        result = forward_batch(runtime, command, sync, status)
        exchange_outcomes(result.outcome, args.world_size, runtime.control_group)
