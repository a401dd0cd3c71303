"""Terminal niceties shared by the front ends: progress bars on stderr."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

stderr = Console(stderr=True)


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool | None = None):
    """Yield `update(completed)`; shows a byte progress bar on an interactive stderr, nothing otherwise."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda completed: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda completed: progress.update(task, completed=completed)
