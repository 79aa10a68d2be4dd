"""Where an agent runs and how much it can be trusted to stay."""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass


class Reliability(enum.Enum):
    RELIABLE = "reliable"
    SPOT = "spot"  # may be reclaimed at any time; never the retained copy


@dataclass(frozen=True, slots=True)
class Labels:
    host: str = ""
    rack: str = ""
    zone: str = ""

    @classmethod
    def local(cls, **overrides: str) -> Labels:
        """Labels for this process: the hostname, unless overridden."""
        return cls(**{"host": socket.gethostname(), **overrides})

    @classmethod
    def parse(cls, value: Labels | dict[str, str] | None) -> Labels:
        if value is None:
            return cls.local()
        if isinstance(value, Labels):
            return value
        unknown = set(value) - {"host", "rack", "zone"}
        if unknown:
            raise ValueError(f"unknown topology label(s) {sorted(unknown)}; use host, rack, zone")
        return cls.local(**value)

    def tier(self, other: Labels) -> int:
        """0 same host, 1 same rack, 2 same zone, 3 elsewhere. Empty labels never match."""
        if self.host and self.host == other.host:
            return 0
        if self.rack and self.rack == other.rack:
            return 1
        if self.zone and self.zone == other.zone:
            return 2
        return 3
