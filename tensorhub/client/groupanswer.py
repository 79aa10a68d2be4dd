"""One Resolve per engine: a group answer, resolved by one member, handed to
the others over the engine's own channel.

    member 0 ──Resolve(group, members=[1..n-1], lease)──▶ server   (one message per engine and version)
        │ GroupAnswer (the answer's bytes, its lease)
        ├──── engine channel (a TP group's broadcast, collective_rpc) ────▶ members 1..n-1
        ▼                                                                     │ adopt: decoded as their own
    pull(answer=)                                                         pull(answer=)
        └──── all done (the engine's barrier) ──▶ member 0 releases the lease ◀┘

The workers of one engine read the same version from the same holders (the
server ranks one list per group), so one answer serves them all. A member
whose history differs (it never saw a holder's layout the answer names: it
joined late, or pulled alone) cannot use it (``ShareUnusable``) and resolves
on its own, as every member did before: the share saves messages, it never
decides what is read. The lease covers every member's reads; members renew
it while they read, and only the resolving member releases it.
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

    def __repr__(self) -> str:
        return (f"GroupAnswer({self.model!r} v{self.version}, group {self.group!r}, lease {self.lease_id[:8]}, "
                f"{len(self.data)} B)")
