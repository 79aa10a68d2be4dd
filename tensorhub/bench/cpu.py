"""CPU seconds a process has used so far, for benchmarks that charge a
server's work to what it answered.

``/proc/<pid>/stat`` counts user + system time in clock ticks (10 ms here):
a stage of a hundred small calls read before and after moves by whole ticks,
and a benchmark summing a dozen such readings per step was ±30 ms off, the
size of what an optimization of the reference server saves. The scheduler's
own account, ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on the CPU,
per thread; the gRPC server's threads included), is read instead where the
kernel keeps it."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """Seconds ``pid`` (every thread of it) has run on a CPU so far."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):  # no schedstat (a kernel without it), or a thread that just ended
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
