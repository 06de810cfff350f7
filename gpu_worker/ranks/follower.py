"""What the ranks other than 0 (the followers) do.

They sleep in the relay broadcast, run what rank 0 sends (releasing their pipelines' memory on
`SleepGroup`, taking it back before the next batch), and take rank 0's stop decision after every
step.
"""

from __future__ import annotations

from dataclasses import replace
from multiprocessing.connection import Connection

from kiln.gpu_worker.protocol import RunBatch, ShutdownGroup, SleepGroup, WakeGroup
from kiln.gpu_worker.ranks.forward import StepSync, forward_batch
from kiln.gpu_worker.ranks.relay import exchange_outcomes, receive_command
from kiln.gpu_worker.ranks.sleep import sleep_rank, wake_rank
from kiln.gpu_worker.ranks.start import RankRuntime


def follow(runtime: RankRuntime, status: Connection) -> None:
    """Serve rank 0's batches until it relays a shutdown; raises if a collective breaks."""
    args = runtime.args
    woke_s = 0.0  # a wake rank 0 relayed ahead of its batch, reported with that batch
    while True:
        assert runtime.idle_group is not None  # a follower implies world_size > 1
        command = receive_command(runtime.idle_group)
        if isinstance(command, ShutdownGroup):
            return
        if isinstance(command, SleepGroup):
            sleep_rank(runtime, command.mode)
            woke_s = 0.0  # woken for a batch rank 0 then refused whole: nobody waited
            continue
        if isinstance(command, WakeGroup):
            woke_s = wake_rank(runtime)
            continue
        if not isinstance(command, RunBatch):
            raise RuntimeError(f"rank {args.rank}: unexpected relay {command!r}")
        woke_s += wake_rank(runtime)  # asleep still if rank 0 refused the batch that woke it
        sync = StepSync(command, runtime.control_group, None)
        result = forward_batch(runtime, command, sync, status)
        outcome = replace(result.outcome, wake_s=woke_s)
        woke_s = 0.0
        exchange_outcomes(outcome, args.world_size, runtime.control_group)
