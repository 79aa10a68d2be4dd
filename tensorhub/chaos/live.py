"""The campaign's live line (rich): one line kept up to date while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.live import Live
from rich.text import Text

from tensorhub.chaos.tally import Tally


@contextlib.contextmanager
def live_line(quiet: bool = False) -> Iterator[Callable[[Tally], None]]:
    """A function that shows a tally's line (on stderr), for the duration; a no-op when quiet."""
    if quiet:
        yield lambda tally: None
        return
    with Live(Text("starting the emulated hosts and processes"), console=Console(stderr=True),
              refresh_per_second=2) as live:
        yield lambda tally: live.update(Text(tally.line()))
