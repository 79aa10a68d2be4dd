"""MoE experts under both names: a checkpoint's per-expert tensors (and any
box or flat range of them) are boxes of the fused transformers-5 tensors, so a
per-expert destination pulls a fused version in place."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Hub, Manifest, ManifestMismatch, Shard, experts
from tensorhub.testing import make_tensors

E, I, H = 4, 6, 8  # experts, expert intermediate, hidden
LAYER = "model.layers.3"
FUSED_SPECS = [
    (f"{LAYER}.mlp.experts.gate_up_proj", "bfloat16", (E, 2 * I, H)),
    (f"{LAYER}.mlp.experts.down_proj", "bfloat16", (E, H, I)),
    (f"{LAYER}.mlp.gate.weight", "bfloat16", (E, H)),
]


def _per_expert(fused: dict[str, torch.Tensor], names=("gate_proj", "up_proj", "down_proj"),
                block: str = "mlp") -> dict[str, torch.Tensor]:
    """What save_pretrained writes for the fused tensors (written out by hand)."""
    gate_up, down = fused[f"{LAYER}.mlp.experts.gate_up_proj"], fused[f"{LAYER}.mlp.experts.down_proj"]
    out = {}
    for e in range(E):
        out[f"{LAYER}.{block}.experts.{e}.{names[0]}.weight"] = gate_up[e, :I]
        out[f"{LAYER}.{block}.experts.{e}.{names[1]}.weight"] = gate_up[e, I:]
        out[f"{LAYER}.{block}.experts.{e}.{names[2]}.weight"] = down[e]
    return out


def _fused_manifest() -> Manifest:
    return Manifest.of({n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, _, s in FUSED_SPECS})


def _elements(fused: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.region.flat is not None:
        a, b = shard.region.flat
        return fused.reshape(-1)[a:b]
    return fused[tuple(slice(a, b) for a, b in shard.region.box)].reshape(-1)


@pytest.mark.parametrize(("names", "block"), [(("gate_proj", "up_proj", "down_proj"), "mlp"),
                                              (("w1", "w3", "w2"), "block_sparse_moe")])
def test_every_region_of_an_expert_is_a_box_of_the_fused_tensor(names, block):
    fused = make_tensors(FUSED_SPECS, 5)
    reference = _per_expert(fused, names, block)
    into = {}
    for i, (name, t) in enumerate(reference.items()):
        rows, cols = t.shape
        # whole, rows, columns, a box and a flat range: every kind a reader holds
        kind = i % 5
        if kind == 0:
            into[name] = torch.empty_like(t)
        elif kind == 1:
            into[name] = [Shard(torch.empty(rows // 2, cols, dtype=t.dtype), t.shape, rows=(0, rows // 2))]
        elif kind == 2:
            into[name] = [Shard(torch.empty(rows, cols - 3, dtype=t.dtype), t.shape, cols=(3, cols))]
        elif kind == 3:
            into[name] = [Shard(torch.empty(2, 2, dtype=t.dtype), t.shape, box=((1, 3), (2, 4)))]
        else:
            into[name] = [Shard(torch.empty(7, dtype=t.dtype), t.shape, flat=(5, 12))]
    # the router: Mixtral's checkpoint names it block_sparse_moe.gate, its transformers-5 model mlp.gate
    into[f"{LAYER}.{block}.gate.weight"] = torch.empty(E, H, dtype=torch.bfloat16)
    mapped = experts.onto(into, _fused_manifest())
    assert set(mapped) == {n for n, _, _ in FUSED_SPECS}  # every per-expert name went to its fused home
    _fused_manifest().check_destination(mapped, model="m", version=0)  # regions fit, nothing overlaps
    memory = {id(s.tensor) for n, v in mapped.items() if n != f"{LAYER}.mlp.gate.weight" for s in v}
    assert len(memory) == len(reference)  # the destinations' own tensors, no copy
    for name, shards in mapped.items():
        if name.endswith(".gate.weight"):
            continue
        for s in shards:
            # fill each destination with what the fused tensor holds at its region: it must be
            # the reference's elements at the per-expert region it was made for
            s.tensor.copy_(_elements(fused[name], s).reshape(s.tensor.shape))
    for name, entry in into.items():
        if name.endswith(".gate.weight"):
            continue
        want = reference[name]
        got = entry if isinstance(entry, torch.Tensor) else entry[0]
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want), name
        else:
            assert torch.equal(got.tensor.reshape(-1), _elements(want, got)), name


def test_names_or_shapes_of_neither_convention_are_left_for_the_manifest_check():
    manifest = _fused_manifest()
    into = {
        f"{LAYER}.mlp.experts.{E}.gate_proj.weight": torch.empty(I, H),  # expert out of range
        f"{LAYER}.mlp.experts.0.gate_proj.weight": torch.empty(I + 1, H),  # wrong shape
        f"{LAYER}.mlp.experts.0.down_proj.weight": torch.empty(H, I),  # fits
        "model.layers.9.mlp.experts.0.up_proj.weight": torch.empty(I, H),  # no fused home
    }
    mapped = experts.onto(into, manifest)
    assert set(mapped) == {f"{LAYER}.mlp.experts.{E}.gate_proj.weight", f"{LAYER}.mlp.experts.0.gate_proj.weight",
                           "model.layers.9.mlp.experts.0.up_proj.weight", f"{LAYER}.mlp.experts.down_proj"}
    assert "gate_up_proj" in experts.mismatch_hint(list(into), manifest)
    assert experts.mismatch_hint(["a.weight"], Manifest.of({"b": torch.empty(2, device="meta")})) is None


def test_a_per_expert_reader_pulls_a_fused_version_in_place(server, hubs):
    """Real NIXL, real gRPC: the trainer publishes fused experts; a reader with a
    checkpoint's per-expert tensors (a TP=2 rank: gate/up rows, down columns)
    pulls them by ``into=`` a function of the manifest, exactly those bytes."""
    trainer = hubs("trainer")
    trainer.call("publish", model="moe", version=1, specs=FUSED_SPECS, seed=9)
    reference = _per_expert(make_tensors(FUSED_SPECS, 9))
    half = I // 2
    into = {}
    for name, t in reference.items():
        if name.endswith("down_proj.weight"):
            into[name] = [Shard(torch.empty(H, half, dtype=t.dtype), t.shape, cols=(0, half))]
        else:
            into[name] = [Shard(torch.empty(half, H, dtype=t.dtype), t.shape, rows=(0, half))]
    router = torch.empty(E, H, dtype=torch.bfloat16)
    into[f"{LAYER}.mlp.gate.weight"] = router
    with Hub.connect(server.address, name="reader") as hub:
        with pytest.raises(ManifestMismatch, match="not in the version"):
            hub.pull("moe", 1, into=into)  # the per-expert names as they are
        result = hub.pull("moe", 1, into=lambda manifest: experts.onto(into, manifest))
    assert result.nbytes == sum(s.tensor.numel() * 2 for v in into.values() if isinstance(v, list) for s in v) \
        + router.numel() * 2
    for name, want in reference.items():
        got = into[name][0].tensor
        if name.endswith("down_proj.weight"):
            assert torch.equal(got, want[:, :half]), name
        else:
            assert torch.equal(got, want[:half]), name
    assert torch.equal(router, make_tensors(FUSED_SPECS, 9)[f"{LAYER}.mlp.gate.weight"])


def test_expert_sharded_trainer_ranks_serve_a_per_expert_reader(server, hubs):
    """FSDP2 ``Shard(0)`` of fused experts, which is also an expert-parallel
    trainer's layout: each rank holds whole experts (uneven here: 1 and 3).
    A TP=2 reader of per-expert names reads its halves from both ranks."""
    ranks = [hubs(f"rank{r}") for r in range(2)]
    for r, rank in enumerate(ranks):
        rank.call("publish_shard", model="moe", version=2, specs=FUSED_SPECS, seed=4, how="rows", rank=r, world=2)
    reference = _per_expert(make_tensors(FUSED_SPECS, 4))
    half = I // 2
    into = {f"{LAYER}.mlp.gate.weight": torch.empty(E, H, dtype=torch.bfloat16)}
    for name, t in reference.items():
        if name.endswith("down_proj.weight"):
            into[name] = [Shard(torch.empty(H, half, dtype=t.dtype), t.shape, cols=(half, I))]
        else:
            into[name] = [Shard(torch.empty(half, H, dtype=t.dtype), t.shape, rows=(half, I))]
    with Hub.connect(server.address, name="reader") as hub:
        result = hub.pull("moe", 2, into=lambda manifest: experts.onto(into, manifest))
    assert set(result.bytes_by_source) == {"rank0", "rank1"}, result.bytes_by_source
    for name, want in reference.items():
        got = into[name][0].tensor
        assert torch.equal(got, want[:, half:] if name.endswith("down_proj.weight") else want[half:]), name



def _per_expert_manifest(names=("gate_proj", "up_proj", "down_proj"), block: str = "mlp") -> Manifest:
    fused = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, _, s in FUSED_SPECS}
    per_expert = _per_expert(fused, names, block)
    return Manifest.of({**per_expert, f"{LAYER}.mlp.gate.weight": fused[f"{LAYER}.mlp.gate.weight"]})


GATE_UP, DOWN, ROUTER = (n for n, _, _ in FUSED_SPECS)


@pytest.mark.parametrize(("names", "block"), [(("gate_proj", "up_proj", "down_proj"), "mlp"),
                                              (("w1", "w3", "w2"), "block_sparse_moe")])
def test_a_fused_destination_takes_a_per_expert_version_expert_by_expert(names, block):
    """The other way round (an engine whose checkpoint was saved fused): whole
    fused tensors and boxes of them, a box across the gate/up boundary too,
    become shards of the version's per-expert tensors over the same memory."""
    fused = make_tensors(FUSED_SPECS, 6)
    reference = _per_expert(fused, names, block)
    first = Shard(torch.empty(1, 2, H, dtype=torch.bfloat16), (E, 2 * I, H), box=((0, 1), (I - 1, I + 1), (0, H)))
    across = Shard(torch.empty(2, 5, H, dtype=torch.bfloat16), (E, 2 * I, H), box=((1, 3), (I - 2, I + 3), (0, H)))
    columns = Shard(torch.empty(1, 2 * I, 3, dtype=torch.bfloat16), (E, 2 * I, H), box=((3, 4), (0, 2 * I), (2, 5)))
    into = {GATE_UP: [first, across, columns], DOWN: torch.empty(E, H, I, dtype=torch.bfloat16),
            ROUTER: torch.empty(E, H, dtype=torch.bfloat16)}
    manifest = _per_expert_manifest(names, block)
    mapped = experts.onto(into, manifest)
    assert {n for n in mapped if ".experts." in n} == set(reference)
    manifest.check_destination(mapped, model="m", version=0)  # regions fit, nothing overlaps
    for name, v in mapped.items():
        for s in v if isinstance(v, list) else []:
            assert s.tensor.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in
                                                             (first.tensor, across.tensor, columns.tensor,
                                                              into[DOWN])}
            s.tensor.copy_(_elements(reference[name], s).reshape(s.tensor.shape))  # what a pull writes there
    assert torch.equal(first.tensor, fused[GATE_UP][0:1, I - 1:I + 1])
    assert torch.equal(across.tensor, fused[GATE_UP][1:3, I - 2:I + 3])
    assert torch.equal(columns.tensor, fused[GATE_UP][3:4, :, 2:5])
    assert torch.equal(into[DOWN], fused[DOWN])
    # an expert no box reads (an expert-parallel worker's): the manifest check names what is missing
    with pytest.raises(ManifestMismatch, match=rf"missing '{LAYER}.{block}.experts.0.{names[0]}.weight'"):
        manifest.check_destination(experts.onto({**into, GATE_UP: [across, columns]}, manifest), model="m",
                                   version=0)


def test_a_fused_reader_pulls_a_per_expert_version_in_place(server, hubs):
    """Real NIXL, real gRPC: the trainer publishes a checkpoint's per-expert
    tensors; a TP=2 rank of an engine whose checkpoint is fused (its rows of
    every expert's gate and up, its columns of down) pulls exactly those bytes."""
    fused = make_tensors(FUSED_SPECS, 11)
    per_expert = {**_per_expert(fused), ROUTER: fused[ROUTER]}
    half = I // 2
    into = {GATE_UP: [Shard(torch.empty(E, half, H, dtype=torch.bfloat16), (E, 2 * I, H),
                            box=((0, E), (i * I, i * I + half), (0, H))) for i in range(2)],
            DOWN: [Shard(torch.empty(E, H, half, dtype=torch.bfloat16), (E, H, I), box=((0, E), (0, H), (0, half)))],
            ROUTER: torch.empty(E, H, dtype=torch.bfloat16)}
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="reader") as hub:
        trainer.publish("moe-per-expert", 1, {n: t.contiguous() for n, t in per_expert.items()})
        result = hub.pull("moe-per-expert", 1, into=lambda manifest: experts.onto(into, manifest))
    assert result.nbytes == sum(s.tensor.nbytes for v in into.values() if isinstance(v, list) for s in v) + E * H * 2
    assert torch.equal(into[GATE_UP][0].tensor, fused[GATE_UP][:, :half])
    assert torch.equal(into[GATE_UP][1].tensor, fused[GATE_UP][:, I:I + half])
    assert torch.equal(into[DOWN][0].tensor, fused[DOWN][:, :, :half])
    assert torch.equal(into[ROUTER], fused[ROUTER])
