"""The data path of the simulation: a link model instead of bytes.

Every GPU has one NIC (``nic`` bytes/s, full duplex); FSDP ranks are GPUs too.
Engines start together and relay (pipeline replication):

    wave 0: the trainer's egress (R x nic) feeds R/8 engines at full rate; their
            workers read their cuts out of row-sharded ranks, priced by the cost
            model (exact runs or whole rows cut locally): under TP column slices
            of every expert (the strided hop), under EP whole experts (one run
            per rank); the layout only changes ``first_hop_*``; with the trainer's
            cut (``--trainer-cut``, versions after the first) one contiguous READ
            per region from the rank that holds it, after the ranks gathered
            their shares (``cuts.cut_hop``)
    chains: every other engine reads from an engine cut like itself (same box:
            one contiguous READ per chunk), one chain behind each wave-0 engine,
            a chunk behind its upstream; a chain moves no faster than its head

    predicted = control plane + max(first hop, relay hop) + depth x (one chunk's hop)
    link limit = bytes per receiving GPU / nic

Pure; ``run.py`` feeds it what the real server and planner measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorhub.transport.cost import LinkCost


@dataclass(frozen=True, slots=True)
class Prediction:
    predicted_s: float
    link_limit_s: float
    first_hop_s: float
    relay_hop_s: float
    depth: int  # hops from the trainer of the farthest engine
    wave0_engines: int
    trainer_egress_bytes: int
    relay_bytes: int


def wave0_engines(engines: int, trainer_ranks: int, tp: int) -> int:
    """The engines that read the trainer (one worker per trainer rank); engine
    ``e`` past them relays from engine ``e - wave0``, a chain behind each."""
    return max(1, min(engines, trainer_ranks // tp))


def predict(*, engines: int, trainer_ranks: int, tp: int, bytes_per_gpu: int, first_hop_s: float,
            first_hop_read_bytes: int, chunk: int, link: LinkCost, control_plane_s: float) -> Prediction:
    wave0 = wave0_engines(engines, trainer_ranks, tp)
    chunks = max(1, math.ceil(bytes_per_gpu / chunk))
    relay_hop_s = link.read_s(chunks, bytes_per_gpu)
    depth = math.ceil((engines - wave0) / wave0)  # chain length behind each wave-0 engine
    # The trainer's egress shared by wave 0: every rank sends its share of each reader's first-hop bytes.
    trainer_s = wave0 * tp * first_hop_read_bytes / (trainer_ranks * link.bandwidth)
    head_s = max(first_hop_s, trainer_s)
    chunk_hop_s = link.read_s(1, min(chunk, bytes_per_gpu))
    body_s = max(head_s, relay_hop_s if depth else 0.0) + depth * chunk_hop_s
    return Prediction(
        predicted_s=control_plane_s + body_s,
        link_limit_s=bytes_per_gpu / link.bandwidth,
        first_hop_s=head_s,
        relay_hop_s=relay_hop_s,
        depth=depth,
        wave0_engines=wave0,
        trainer_egress_bytes=wave0 * tp * first_hop_read_bytes,
        relay_bytes=(engines - wave0) * tp * bytes_per_gpu,
    )
