"""Rank 0's stop decisions (`LeaderLink`), with the test as the coordinator's end of its pipes.

The verdict on step k is taken at the end of step k + 1; rank 0 waits for it (at most
`verdict_wait_s`, here far longer than any test runs) only when the coordinator is behind. A run
resumed from a checkpoint waits for no verdict on a step it skipped, and a request that would stop
to resume elsewhere runs its last step to the end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import pytest

from kiln.gpu_worker.protocol import StepDone, StopVerdict
from kiln.gpu_worker.ranks.leader import LeaderLink
from tests.waiting import GENEROUS_S, wait_until

BATCH = 1
STEPS = 8


class Coordinator:
    """The coordinator's ends of rank 0's pipes: verdicts in, step reports out."""

    def __init__(self, commands: Connection, results: Connection) -> None:
        self.commands = commands
        self.results = results

    def verdict(self, after_step: int, stop: set[str], checkpoint: set[str]) -> None:
        self.commands.send(StopVerdict(BATCH, after_step, frozenset(stop), frozenset(checkpoint)))

    def reported(self) -> list[int]:
        """The steps rank 0 reported so far."""
        steps = []
        while self.results.poll(0):
            message = self.results.recv()
            assert isinstance(message, StepDone)
            steps.append(message.step)
        return steps


@pytest.fixture
def pipes() -> Iterator[tuple[LeaderLink, Coordinator]]:
    commands_in, commands_out = Pipe(duplex=False)
    results_in, results_out = Pipe(duplex=False)
    # a verdict that is late stalls rank 0 for longer than the test would wait
    link = LeaderLink(commands_in, results_out, verdict_wait_s=10 * GENEROUS_S)
    link.begin(BATCH)
    yield link, Coordinator(commands_out, results_in)
    for end in (commands_in, commands_out, results_in, results_out):
        end.close()


def test_a_run_resumed_after_step_3_decides_its_step_4_without_a_verdict_on_step_3(
    pipes: tuple[LeaderLink, Coordinator],
) -> None:
    """No verdict comes for a step the run skipped: its first step must not wait for one."""
    link, coordinator = pipes
    decided: list[frozenset[str]] = []
    first = threading.Thread(target=lambda: decided.append(link.decide_stops(4, STEPS)))
    first.daemon = True  # before the fix it waits verdict_wait_s
    first.start()
    wait_until(lambda: decided, what="the resumed run's first stop decision")
    assert decided == [frozenset()]
    assert coordinator.reported() == [4]

    # from there on, the verdict on the step before is awaited as in any run
    coordinator.verdict(4, {"r"}, set())
    assert link.decide_stops(5, STEPS) == {"r"}


def test_a_stop_to_resume_elsewhere_lets_the_last_step_run_to_the_end_and_a_cancel_does_not(
    pipes: tuple[LeaderLink, Coordinator],
) -> None:
    """The last step's state is the output, never checkpointed: stopping there loses every step."""
    link, coordinator = pipes
    for step in range(1, STEPS - 1):
        coordinator.verdict(step, set(), set())
        assert link.decide_stops(step, STEPS) == frozenset()
    assert link.decide_stops(STEPS - 1, STEPS) == frozenset()
    # read at the end of the last step: "drained" hands back (checkpointed), "canceled" is a cancel
    coordinator.verdict(STEPS - 1, {"drained", "canceled"}, {"drained"})
    assert link.decide_stops(STEPS, STEPS) == {"canceled"}
    assert coordinator.reported() == list(range(1, STEPS + 1))
