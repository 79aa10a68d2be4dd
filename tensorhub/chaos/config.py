"""The knobs of a fault campaign (``tensorhub chaos``): its size, its pace and
the deadlines every operation runs under."""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.chaos.schedule import KINDS


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    minutes: float = 10.0
    seed: int = 0
    readers: int = 4
    trainer_ranks: int = 2
    scale: float = 1.0  # 1.0: 8 MiB versions in 1 MiB chunks
    link: str = "1gbit"
    slow_rate: str = "16mbit"
    step_s: float = 2.0  # a new version this often
    mean_gap_s: float = 2.2  # between faults (10 minutes: about 270 scheduled)
    kinds: tuple[str, ...] = KINDS
    pull_timeout_s: float = 30.0
    wait_s: float = 2.0  # a reader's wait for a version newer than it holds
    unpublish_timeout_s: float = 8.0
    chunk_timeout_s: float = 3.0
    rpc_timeout_s: float = 5.0
    agent_ttl_s: float = 5.0
    lease_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.readers < 1 or self.trainer_ranks < 1:
            raise ValueError("--minutes must be > 0, --readers and --trainer-ranks >= 1")
