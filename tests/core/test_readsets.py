"""A destination checked once is not checked again while it is the same
(``client/readsets``): the same buffers give the last pull's parts, holding
the tensors given now, and its read layout; any change a check or a layout
depends on (another region, buffer, dtype, chunk size, registered memory)
checks and lays out anew, and a bad destination is refused every time. Real
manifests and tensors; no server (nothing here crosses a process)."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Manifest, Region, Shard
from tensorhub.client.readsets import ReadSets
from tensorhub.errors import InvalidRequest, ManifestMismatch
from tensorhub.transport.memory import regions_of

SHAPE = (64, 32)


def _manifest() -> Manifest:
    return Manifest.of({n: torch.empty(SHAPE, dtype=torch.bfloat16, device="meta") for n in ("a", "b")})


def _into(buffer: torch.Tensor, rows: tuple[int, int] = (0, 16)) -> dict:
    """Rows ``rows`` of a, columns 0:8 of b, back to back in ``buffer``."""
    a = Region.of(SHAPE, rows=rows)
    b = Region.of(SHAPE, cols=(0, 8))
    n = a.numel(SHAPE)
    return {"a": Shard(buffer[:n].view(a.local_shape(SHAPE)), SHAPE, box=a.box),
            "b": Shard(buffer[n: n + b.numel(SHAPE)].view(b.local_shape(SHAPE)), SHAPE, box=b.box)}


def _layout(sets: ReadSets, manifest: Manifest, read_set, chunk_size: int = 256):
    return sets.layout(read_set, manifest, regions_of([p.tensor for p in read_set.parts])[1], chunk_size)


def test_the_same_destination_is_checked_and_laid_out_once():
    manifest, sets = _manifest(), ReadSets()
    buffer = torch.zeros(2048, dtype=torch.bfloat16)
    first = sets.parts(manifest, _into(buffer), model="m", version=1)
    layout = _layout(sets, manifest, first)

    into = _into(buffer)  # new Shard and view objects over the same memory
    again = sets.parts(manifest, into, model="m", version=2)
    assert [p.tensor for p in again.parts] == [into["a"].tensor, into["b"].tensor]  # this pull's very tensors
    assert all(p.tensor is t for p, t in zip(again.parts, (into["a"].tensor, into["b"].tensor)))
    assert [(p.name, p.region) for p in again.parts] == [(p.name, p.region) for p in first.parts]
    assert _layout(sets, manifest, again) is layout
    third = sets.parts(manifest, into, model="m", version=3)  # the same objects again
    assert all(p.tensor is t for p, t in zip(third.parts, (into["a"].tensor, into["b"].tensor)))
    assert _layout(sets, manifest, again, chunk_size=512) is not layout  # another chunk size: laid out anew


@pytest.mark.parametrize("change", ["rows", "buffer", "dtype"])
def test_a_changed_destination_is_checked_anew(change):
    manifest, sets = _manifest(), ReadSets()
    buffer = torch.zeros(2048, dtype=torch.bfloat16)
    first = sets.parts(manifest, _into(buffer), model="m", version=1)
    layout = _layout(sets, manifest, first)
    if change == "rows":
        into = _into(buffer, rows=(16, 32))
    elif change == "buffer":
        into = _into(torch.zeros(2048, dtype=torch.bfloat16))
    else:  # the same memory as float16: the check refuses it
        into = _into(buffer.view(torch.float16))
        with pytest.raises(ManifestMismatch, match="float16"):
            sets.parts(manifest, into, model="m", version=2)
        return
    again = sets.parts(manifest, into, model="m", version=2)
    assert again.seen is not first.seen
    assert again.parts[0].region == Region.of(SHAPE, rows=(16, 32) if change == "rows" else (0, 16))
    assert _layout(sets, manifest, again) is not layout


def test_a_bad_destination_is_refused_every_time():
    manifest, sets = _manifest(), ReadSets()
    into = _into(torch.zeros(2048, dtype=torch.bfloat16))
    for _ in range(2):  # a refused check is never kept
        with pytest.raises(ManifestMismatch, match="missing 'b'"):
            sets.parts(manifest, {"a": into["a"]}, model="m", version=1)
    with pytest.raises(InvalidRequest, match="expected a tensor"):
        sets.parts(manifest, {"a": into["a"], "b": "not a tensor"}, model="m", version=1)
    assert sets.parts(manifest, into, model="m", version=1).seen is not None  # good once whole
