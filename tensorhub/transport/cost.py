"""What a READ costs on each transport, so a reader can choose between reading
a holder's exact element runs (one descriptor each) and a wider contiguous
span it cuts locally (one descriptor, more bytes).

    read_s(descriptors, nbytes) = descriptors * per_descriptor_s + nbytes / bandwidth
    exact_s(runs, wanted)       = read_s(runs, wanted)
    wide_s(span, wanted)        = read_s(1, span) + wanted / cut_bandwidth   (the local strided copy)

Where each figure comes from is written beside it. Shared memory and TCP were
measured here (NIXL 1.5.1, UCX 1.23, two processes on this project's 2-core
machine; ``measure`` is the procedure, ``tensorhub bench pull --layout moe``
runs it and prints what it finds beside these defaults). RDMA and NVLink are
documented figures, not measured here: no such link on this machine.

Pure: no NIXL, no I/O; ``measure`` takes the READ to time as a function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

# A strided copy out of a scratch buffer (numpy, one core), in bytes of its
# destination per second: about 8 GB/s (measured: docs/history/transport-costs.md).
CUT_BANDWIDTH = 8e9


@dataclass(frozen=True, slots=True)
class LinkCost:
    """One transport's cost of a READ: a fixed cost per descriptor (seconds)
    and the bytes per second that cross it."""

    name: str
    per_descriptor_s: float
    bandwidth: float
    cut_bandwidth: float = CUT_BANDWIDTH

    def read_s(self, descriptors: np.ndarray | int, nbytes: np.ndarray | int) -> np.ndarray | float:
        return descriptors * self.per_descriptor_s + nbytes / self.bandwidth

    def exact_s(self, runs: np.ndarray | int, wanted: np.ndarray | int) -> np.ndarray | float:
        """``runs`` descriptors that move exactly the ``wanted`` bytes."""
        return self.read_s(runs, wanted)

    def wide_s(self, span: np.ndarray | int, wanted: np.ndarray | int) -> np.ndarray | float:
        """One descriptor of ``span`` bytes into scratch, then the ``wanted`` bytes cut out of it."""
        return self.read_s(1, span) + wanted / self.cut_bandwidth


BACKENDS: dict[str, LinkCost] = {
    # UCX over shared memory (CMA: one process_vm_readv per descriptor): about
    # 2.5 us per descriptor and 4-8 GB/s, measured with raw NIXL READs
    # (docs/history/transport-costs.md).
    "shm": LinkCost("shm", 2.5e-6, 6e9),
    # UCX over TCP (its software-emulated get): 2.4 us per descriptor over
    # loopback (docs/history/transport-costs.md). The bandwidth is a 10 Gbit/s NIC's: a
    # slower link (``bench cluster``'s 1 Gbit/s) makes wide reads costlier
    # still, so this errs towards exact runs.
    "tcp": LinkCost("tcp", 2.4e-6, 1.25e9),
    # UCX over InfiniBand / RoCE verbs: not measured here. A 400 Gbit/s NIC per
    # GPU (ConnectX-7, the paper-scale goal of issue 29): 50 GB/s. Per
    # descriptor: one ucp_get_nbx request each in NIXL's UCX backend, about a
    # microsecond of software; the NIC's message rate (hundreds of millions per
    # second) is not the limit.
    "rdma": LinkCost("rdma", 1e-6, 50e9),
    # UCX cuda_ipc between GPUs of one host: not measured here. H100 SXM NVLink
    # 4: 900 GB/s both ways (NVIDIA's datasheet), 450 GB/s one way. Per
    # descriptor: a cudaMemcpyAsync each, whose launch costs several
    # microseconds: so short runs are wide reads there almost always.
    "nvlink": LinkCost("nvlink", 5e-6, 450e9),
}

SETTINGS = ("auto", "exact", *BACKENDS)


def pick(setting: str, *, same_host: bool, device_memory: bool) -> LinkCost | None:
    """The cost model of a reader's link to a holder. ``setting``: a backend's
    name (the link is known), "exact" (never read more than asked: None), or
    "auto": shared memory within a host (NVLink between GPU memories), TCP
    between hosts (UCX may use RDMA there, which only a setting can say: TCP's
    figures make fewer wide reads, the safer mistake on a slow link)."""
    if setting == "exact":
        return None
    if setting in BACKENDS:
        return BACKENDS[setting]
    if setting != "auto":
        raise ValueError(f"read cost {setting!r} is not one of {', '.join(SETTINGS)}")
    if not same_host:
        return BACKENDS["tcp"]
    return BACKENDS["nvlink" if device_memory else "shm"]


# ---------------------------------------------------------------- measuring

ReadFn = Callable[[int, int, int], float]  # (descriptors, bytes each, stride) -> seconds of one READ

# What ``measure`` times: many short descriptors (their fixed cost shows) and
# one long one (the bandwidth shows). Each must fit the buffers given to ``read``.
PROBES = ((16384, 64, 4096), (4096, 4096, 8192), (1, 64 << 20, 0))


def fit(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(seconds per descriptor, bytes per second) that best explain
    ``samples`` of (descriptors, bytes, seconds), by least squares on the
    relative error (a 60 ms READ would otherwise drown a 40 ms one's fit)."""
    a = np.array([(d, n) for d, n, _ in samples], np.float64)
    t = np.array([s for _, _, s in samples], np.float64)
    (per_desc, per_byte), *_ = np.linalg.lstsq(a / t[:, None], np.ones(len(t)), rcond=None)
    return max(float(per_desc), 0.0), 1.0 / max(float(per_byte), 1e-15)


def measure(name: str, read: ReadFn, *, reps: int = 3, probes=PROBES) -> LinkCost:
    """A ``LinkCost`` measured on a live link: ``read(descriptors, nbytes,
    stride)`` posts one READ of that many descriptors of ``nbytes`` each,
    ``stride`` bytes apart on the holder's side, waits for it and returns its
    seconds. The fastest of ``reps`` per probe (noise only adds)."""
    samples = []
    for descriptors, nbytes, stride in probes:
        read(descriptors, nbytes, stride)  # warm: connections, page tables
        best = min(read(descriptors, nbytes, stride) for _ in range(reps))
        samples.append((descriptors, descriptors * nbytes, best))
    per_desc, bandwidth = fit(samples)
    return replace(BACKENDS.get(name, LinkCost(name, 0.0, 1.0)), name=f"{name} (measured)",
                   per_descriptor_s=per_desc, bandwidth=bandwidth)
