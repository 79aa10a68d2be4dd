"""A stand-in trainer: a separate OS process with its own Hub that publishes
versions of the tiny model on command. One command per stdin line, one reply
per stdout line:

    publish VERSION original|perturbed|sparse|wrong-vocab|missing [delta-from U]  -> "published VERSION"
        (delta-from: with its delta from version U, which it still publishes)
    corrupt VERSION NAME INDEX                      -> "corrupted VERSION"
        (adds 1 to element INDEX of tensor NAME in the published memory, which
        the publisher's checksums no longer match)
    publish VERSION hf DIR                          -> "published VERSION"
        (the transformers model in DIR, as its own state_dict(): MoE experts fused)
    unpublish VERSION                               -> "unpublished VERSION"
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tensorhub import Hub

MISSING = "model.layers.1.mlp.down_proj.weight"  # what the "missing" kind leaves out


def weights(model_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    original = load_file(str(model_dir / "model.safetensors"))
    if kind == "original":
        return original
    if kind == "perturbed":
        gen = torch.Generator().manual_seed(1)
        return {n: (t.float() + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in original.items()}
    if kind == "sparse":  # 2% of the elements changed, as a small RL step changes bf16 weights
        gen = torch.Generator().manual_seed(2)
        out = {}
        for n, t in original.items():
            mask = torch.rand(t.shape, generator=gen) < 0.02
            out[n] = torch.where(mask, (t.float() + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype), t)
        return out
    if kind == "wrong-vocab":  # a trainer whose tokenizer grew: the manifest no longer matches the engine
        embed = original["model.embed_tokens.weight"]
        return {**original, "model.embed_tokens.weight": torch.cat([embed, embed[:8]])}
    if kind == "missing":  # a version that lacks one layer's tensor
        return {n: t for n, t in original.items() if n != MISSING}
    raise ValueError(kind)


def hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """What a trainer holding the transformers model publishes: its own names
    (transformers 5 fuses MoE experts: ``mlp.experts.gate_up_proj`` [E, 2I, H])."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()


def main(hub_address: str, model_dir: str, model: str, chunk_size: int) -> None:
    hub = Hub.connect(hub_address, name="trainer", chunk_size=chunk_size)
    pubs = {}
    held = {}  # version -> the tensors it was published from (publish reads them in place)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, version, *rest = line.split()
        if cmd == "publish" and rest[0] == "hf":
            pubs[int(version)] = hub.publish(model, int(version), hf_state_dict(Path(rest[1])))
            print(f"published {version}", flush=True)
        elif cmd == "publish":
            delta_from = int(rest[2]) if rest[1:2] == ["delta-from"] else None
            held[int(version)] = weights(Path(model_dir), rest[0])
            pubs[int(version)] = hub.publish(model, int(version), held[int(version)], delta_from=delta_from)
            print(f"published {version}", flush=True)
        elif cmd == "corrupt":
            held[int(version)][rest[0]].view(-1)[int(rest[1])] += 1
            print(f"corrupted {version}", flush=True)
        elif cmd == "unpublish":
            pubs.pop(int(version)).unpublish(timeout=30)
            held.pop(int(version), None)
            print(f"unpublished {version}", flush=True)
    hub.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
