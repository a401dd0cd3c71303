"""Terminal niceties shared by the front ends: progress bars on stderr."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

stderr = Console(stderr=True)


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool | None = None, unit: str = "bytes"):
    """Yield `update(completed)`; shows a progress bar (of bytes, or of items with unit="items") on an
    interactive stderr, nothing otherwise."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda completed: None
        return
    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    columns = (TextColumn("{task.description}"), BarColumn(), count, TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda completed: progress.update(task, completed=completed)
