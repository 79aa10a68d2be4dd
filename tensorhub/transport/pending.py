"""A transfer in flight (``PendingRead``: a READ, or a push's WRITE) and how
one fails (``TransferFailed``): what ``nixl`` hands out and ``push`` keeps."""

from __future__ import annotations

from dataclasses import dataclass


class TransferFailed(Exception):
    """A READ (or push) failed or stalled. ``stalled`` tells a deadline from a NIXL error."""

    def __init__(self, remote: str, detail: str, *, stalled: bool = False, op: str = "READ") -> None:
        super().__init__(f"{op} from {remote} {'stalled' if stalled else 'failed'}: {detail}")
        self.remote = remote
        self.stalled = stalled


@dataclass(slots=True)
class PendingRead:
    """A READ in flight: poll it until done, then release it."""

    remote: str
    handle: object
    done: bool = False
    failed: TransferFailed | None = None  # once failed, failed for good (see poll)
