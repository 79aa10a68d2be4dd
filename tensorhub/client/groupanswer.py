"""One Resolve per engine: a group answer, resolved by one member, handed to
the others over the engine's own channel.

    member 0 ──Resolve(group, members=[1..n-1], lease)──▶ server   (one message per engine and version)
        │ GroupAnswer (the answer's bytes, its lease)
        ├──── engine channel (a TP group's broadcast, collective_rpc) ────▶ members 1..n-1
        ▼                                                                     │ adopt: decoded as their own
    pull(answer=, defer_complete=True)                                    pull(answer=, defer_complete=True)
        │                                   MemberReport (last report held, pulled bytes)
        ◀──── all done: the engine's gather ───────────────────────────────────┘
    send_group_reports ──Batch(reports, pulled, lease release)──▶ server   (one message per engine and version)
        └── a report not taken: that member's heartbeat sends it (report_later)

The workers of one engine read the same version from the same holders (the
server ranks one list per group), so one answer serves them all. A member
whose history differs (it never saw a holder's layout the answer names: it
joined late, or pulled alone) cannot use it (``ShareUnusable``) and resolves
on its own, as every member did before: the share saves messages, it never
decides what is read. The lease covers every member's reads; members renew
it while they read, and only the resolving member releases it.

The end of the update is shared the same way: each member's last report of
what it now serves (complete) and the bytes it read travel over the engine's
channel to member 0, which sends them with the lease's release in one Batch.
Until then the server lists those relays as filling with the chunks they
reported before, so peers still read what they have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupAnswer:
    """What ``Hub.resolve_for_group`` returns: picklable, a few KiB in the steady
    state (holders come lean), for the other members' ``Hub.pull(answer=)``."""

    model: str
    version: int
    group: str
    lease_id: str
    data: bytes  # the serialized ResolveResponse
    # Per withdrawal handed to ``resolve_for_group`` (b"": None), its outcome
    # as ``Hub.send_group_withdrawals`` gives it.
    withdrawn: tuple = ()
    # Per announce handed to ``resolve_for_group`` (``Hub.announce_ahead``; b"":
    # False), whether the server took it.
    announced: tuple = ()

    def __repr__(self) -> str:
        return (f"GroupAnswer({self.model!r} v{self.version}, group {self.group!r}, lease {self.lease_id[:8]}, "
                f"{len(self.data)} B)")


@dataclass(frozen=True, slots=True)
class MemberReport:
    """What one member tells the server at the end of a group's update
    (``Hub.member_report``): picklable, for member 0's ``Hub.send_group_reports``."""

    agent_id: str
    report: bytes = b""  # its serving pull's last report (complete), encoded; b"": none held
    pulled: bytes = b""  # the bytes its pulls read (the server's metrics), encoded; b"": none
