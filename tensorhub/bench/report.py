"""Benchmark rows: printed as a table, written as JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass(kw_only=True, slots=True)
class Row:
    method: str
    readers: int
    bytes: int
    seconds: float  # median over repetitions
    gbps: float
    samples: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, method: str, readers: int, nbytes: int, samples: list[float], **extra: object) -> Row:
        median = statistics.median(samples)
        return cls(method=method, readers=readers, bytes=nbytes, seconds=median,
                   gbps=nbytes * readers / median / 1e9 if median > 0 else 0.0, samples=samples, extra=dict(extra))

    def as_json(self) -> dict:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def print_table(title: str, rows: list[Row], ratios: dict[str, str], console: Console | None = None) -> None:
    """``ratios`` maps a method to its baseline method: a 'x baseline' column."""
    console = console or Console()
    table = Table(title=title)
    for col in ("method", "readers", "bytes", "median s", "GB/s (all readers)", "vs baseline"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in rows:
        base = next((b for b in rows if b.method == ratios.get(row.method) and b.readers == row.readers
                     and b.bytes == row.bytes), None)
        ratio = f"{base.seconds / row.seconds:.2f}x {base.method}" if base else ""
        seconds = f"{row.seconds * 1e3:.2f} ms" if row.seconds < 0.1 else f"{row.seconds:.3f}"
        table.add_row(row.method, str(row.readers), f"{row.bytes:,}", seconds, f"{row.gbps:.2f}", ratio)
    console.print(table)


def write_json(path: str | Path, rows: list[Row], **meta: object) -> None:
    Path(path).write_text(json.dumps({"results": [r.as_json() for r in rows], **meta}, indent=2) + "\n")
