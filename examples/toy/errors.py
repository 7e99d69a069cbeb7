"""The toy's exceptions: a refused command line, and Ctrl-C with the way to resume."""

from __future__ import annotations


class ArgumentError(Exception):
    """An invalid command line: printed as one line on rank 0, exit status 2."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the run: ``how_to_resume`` is the line printed (exit status 130)."""

    def __init__(self, how_to_resume: str) -> None:
        super().__init__(how_to_resume)
        self.how_to_resume = how_to_resume
