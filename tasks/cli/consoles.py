"""The console a command writes its text output to (rich: loaded only by commands that print)."""

from __future__ import annotations

from rich.console import Console


class _PipeConsole(Console):
    """A rich console whose closed pipe raises BrokenPipeError (rich itself exits with 1)."""

    def on_broken_pipe(self) -> None:
        """Stop writing; `cli.main` ends the command quietly."""
        self.quiet = True
        raise BrokenPipeError


def stdout_console() -> Console:
    """The console for a command's output on stdout."""
    return _PipeConsole()
