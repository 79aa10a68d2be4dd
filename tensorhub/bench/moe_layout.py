"""The layer ``bench pull --layout moe`` moves (``bench.moe``, ``bench.moe_raw``):
its configuration, its expert tensors, and where each publisher's rows of them
lie in its one buffer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class MoeBenchConfig:
    experts: int = 128
    hidden: int = 2048
    intermediate: int = 768
    publishers: int = 2
    tp: int = 8  # the reader is TP rank 0 of this many
    reps: int = 5
    warmup: int = 1
    chunk_size: int = 32 << 20
    read_workers: int = 2
    verify: bool = True
    # > 1: after the rows above, the publishers step through this many versions
    # from the same buffers and a fresh reader Hub pulls each: the first is
    # planned, the rest replay its plans (``client/replay.py``), reported apart.
    versions: int = 1

    def __post_init__(self) -> None:
        if self.publishers < 1 or self.intermediate % self.tp or self.hidden % self.publishers:
            raise ValueError("--publishers must be >= 1 and divide the rows; the TP degree must divide 768")


def tensors(cfg: MoeBenchConfig) -> list[tuple[str, tuple[int, int], str]]:
    """(name, shape, how TP rank 0 reads it): "rows" or "cols", per expert."""
    out = []
    for e in range(cfg.experts):
        base = f"model.layers.0.mlp.experts.{e}"
        out += [(f"{base}.gate_proj.weight", (cfg.intermediate, cfg.hidden), "rows"),
                (f"{base}.up_proj.weight", (cfg.intermediate, cfg.hidden), "rows"),
                (f"{base}.down_proj.weight", (cfg.hidden, cfg.intermediate), "cols")]
    return out


def held_rows(shape: tuple[int, int], rank: int, world: int) -> tuple[int, int]:
    """The rows [a, b) of a tensor of ``shape`` that publisher ``rank`` of ``world`` holds."""
    return shape[0] * rank // world, shape[0] * (rank + 1) // world


def holder_offsets(cfg: MoeBenchConfig, rank: int) -> list[int]:
    """Where each tensor's rows lie in publisher ``rank``'s buffer (bytes), and its size last."""
    out, at = [], 0
    for _, shape, _ in tensors(cfg):
        a, b = held_rows(shape, rank, cfg.publishers)
        out.append(at)
        at += (b - a) * shape[1] * 2
    return [*out, at]
