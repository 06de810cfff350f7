"""A declared loop and the runner that starts and stops a process's loops, one thread each.

In the manner of Celery's worker bootsteps: each `Component` says its name, its interval, its
step, and what it does once at start and at stop (what it needs is bound when it is declared);
`Loops` starts them all in order and stops them all.
A step that raises is logged and tried again at the next interval: a background loop outlives
any one bad iteration, and on its own thread a long compute step never starves another loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.storage.errors import StorageError

log = logging.getLogger(__name__)


def never_paused() -> bool:
    """The default `paused`: a component that always runs."""
    return False


def nothing() -> None:
    """The default `start` and `stop`: a component with nothing to set up or tear down."""


@dataclass(frozen=True)
class Component:
    """One loop: `start` once, `step` every `interval_s` (skipped while `paused()`), `stop` once."""

    name: str
    interval_s: float
    step: Callable[[], object]
    paused: Callable[[], bool] = never_paused
    start: Callable[[], object] = nothing  # on the starting thread, before the loop's own
    stop: Callable[[], object] = nothing  # once the loop's thread has ended

    def run_once(self) -> None:
        """One iteration; a failure is logged, never raised (the next interval tries again)."""
        if self.paused():
            return
        try:
            self.step()
        except StorageError as exc:
            log.warning("%s: storage unavailable (%s); will retry", self.name, exc)
        except Exception:  # a background loop must outlive any one bad iteration
            log.exception("%s failed; will retry", self.name)


class Loops:
    """Starts `components` on daemon threads (`start`), stops and joins them (`stop`)."""

    def __init__(self, components: Sequence[Component]) -> None:
        self.components = list(components)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def names(self) -> list[str]:
        """The declared components' names, in declaration order."""
        return [component.name for component in self.components]

    def start(self) -> None:
        """Per component in order: its `start`, then its thread (which waits one interval first).

        A `start` that raises stops the start there (the caller sees it): what it sets up is
        what the loop needs.
        """
        for component in self.components:
            component.start()
            thread = threading.Thread(
                target=self._run, args=(component,), name=f"kiln-{component.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, component: Component) -> None:
        while not self._stop.wait(component.interval_s):
            component.run_once()

    def wait(self) -> None:
        """Block until `ask_to_stop` or `stop` is called (another thread, a signal handler)."""
        self._stop.wait()

    def ask_to_stop(self) -> None:
        """Tell every loop to stop after its step under way; returns at once (signal-safe)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop every loop, join each (5 s at most: its step under way ends), then its `stop`."""
        self._stop.set()
        started = self.components[: len(self._threads)]
        for thread, component in zip(self._threads, started, strict=True):
            thread.join(timeout=5)
            try:
                component.stop()
            except Exception:  # one component's teardown must not skip the others'
                log.exception("%s: stop failed", component.name)
        self._threads.clear()
