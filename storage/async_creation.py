"""`create_and_place` from an event loop (redis.asyncio): the API's submit route runs on it.

The API answers a submission on its event loop, without the thread hop a blocking call costs
(about a third of the API's CPU per job); its one Redis round trip must then not block the loop.
The scripts, their keys and arguments and the reading of their replies are `CreationOps`' own:
only the round trip is here.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio
from redis.exceptions import RedisError

from kiln.storage.base import check_acknowledged, wait_command
from kiln.storage.boundary import translate
from kiln.storage.creation import CreationOps, Placement
from kiln.storage.queues import QueueSnapshot
from kiln.storage.records import JobRecord, NewJob
from kiln.storage.scripts import ScriptCall, first_lost_script, queue_by_sha, source


class AsyncCreation:
    """Creates jobs as `CreationOps.create_and_place` does, through an asyncio Redis client.

    The client belongs to the event loop it was first used on (redis.asyncio connections do).
    """

    def __init__(self, ops: CreationOps, client: redis.asyncio.Redis[str]) -> None:
        self.ops = ops
        self.redis = client

    async def create_and_place(
        self,
        new: NewJob,
        *,
        max_queued: int | None = None,
        max_depth: int | None = None,
        message: tuple[str, str] | None = None,
        place: Placement | None = None,
    ) -> tuple[JobRecord, bool, QueueSnapshot | None]:
        """As `CreationOps.create_and_place`, with the same errors (storage errors, QueueFull)."""
        calls = self.ops.placement_calls(new, max_queued, max_depth, message, place)
        try:
            replies = await self._pipelined(calls)
        except RedisError as exc:
            raise translate(exc) from exc
        return self.ops.placed(new, replies)

    async def _pipelined(self, calls: list[ScriptCall]) -> list[Any]:
        """As `CreationOps._pipelined`: by sha, a script Redis lost loaded and run again."""
        replies = await self._execute(calls, raise_on_error=False)
        rerun_from = first_lost_script(replies)
        if rerun_from is None:
            return replies
        for name in {name for name, _keys, _args in calls}:
            await self.redis.script_load(source(name))
        return [*replies[:rerun_from], *await self._execute(calls[rerun_from:])]

    async def _execute(self, calls: list[ScriptCall], raise_on_error: bool = True) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        queue_by_sha(pipe, calls)
        wait = wait_command(self.ops.settings)  # a 201 only once replicas have the job
        if wait is not None:
            pipe.execute_command(*wait)
        replies = list(await pipe.execute(raise_on_error=raise_on_error))
        if wait is not None:
            check_acknowledged(self.ops.settings, replies.pop())
        return replies

    async def aclose(self) -> None:
        """Close the client and its pool (a client given a pool leaves it open unless told)."""
        # (the installed type stubs predate `aclose`, which replaced `close`)
        await self.redis.aclose(close_connection_pool=True)  # type: ignore[attr-defined]
