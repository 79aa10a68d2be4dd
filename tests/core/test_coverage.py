"""The server's coverage (server/coverage.py) against torch masks: the grouped
classes (visibility, what is missing, retention), the grid check and the
covering prefix (a Resolve's sources) all agree with element-by-element truth,
for random holders of boxes, flat ranges, several regions of one tensor and
whole copies."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.regions import Region
from tensorhub.regiontable import RegionTable, Shapes
from tensorhub.server.coverage import Coverage, Grouping, HolderKeys, covering_prefix, covers
from tensorhub.server.state import check_held

SHAPES = [(6, 4), (6, 4), (5,), (3, 2, 2), (6, 4)]  # two alike pairs: groups get split by the holders
MANIFEST = Manifest(tuple(TensorSpec(f"t{i}", "float32", s, 4 * int(np.prod(s))) for i, s in enumerate(SHAPES)))


@st.composite
def _region(draw, shape):
    kind = draw(st.sampled_from(["whole", "box", "flat", "rows"]))
    n = int(np.prod(shape))
    if kind == "flat":
        a = draw(st.integers(0, n - 1))
        return Region(flat=(a, draw(st.integers(a + 1, n))))
    if kind == "rows":
        a = draw(st.integers(0, shape[0] - 1))
        return Region.of(shape, rows=(a, draw(st.integers(a + 1, shape[0]))))
    if kind == "box":
        box = []
        for d in shape:
            a = draw(st.integers(0, d - 1))
            box.append((a, draw(st.integers(a + 1, d))))
        return Region(box=tuple(box))
    return Region()


@st.composite
def _holder(draw):
    """None (every tensor whole) or a list of (tensor, region), disjoint per tensor."""
    if draw(st.integers(0, 9)) == 0:
        return None
    held = []
    for t, shape in enumerate(SHAPES):
        if draw(st.booleans()):
            continue
        first = draw(_region(shape))
        held.append((t, first))
        if first.flat is None and first.box is not None and first.box[0][1] < shape[0] and draw(st.booleans()):
            rest = Region.of(shape, rows=(first.box[0][1], shape[0]))  # a second region of the same tensor
            held.append((t, rest))
    return held or None


def _masks(holders):
    masks = [torch.zeros(s, dtype=torch.bool) for s in SHAPES]
    for held in holders:
        for t, region in (((t, Region()) for t in range(len(SHAPES))) if held is None else held):
            flat = masks[t].view(-1)
            if region.flat is not None:
                flat[region.flat[0]:region.flat[1]] = True
            else:
                masks[t][tuple(slice(a, b) for a, b in region.bounds(SHAPES[t]))] = True
    return masks


def _tables(holders):
    return [None if h is None else check_held(MANIFEST, h) for h in holders]


@settings(max_examples=250, deadline=None)
@given(st.lists(_holder(), min_size=0, max_size=5))
def test_coverage_classes_grid_and_prefix_match_torch_masks(holders):
    shapes = Shapes.of(MANIFEST)
    tables = _tables(holders)
    grouping = Grouping(shapes)
    for table in tables:
        grouping.refine(table)
    keys = [HolderKeys(t, grouping) for t in tables]
    masks = _masks(holders)
    truth = all(bool(m.all()) for m in masks)
    coverage = Coverage(grouping)
    for k in keys:
        coverage.add(k)
    assert coverage.complete == truth == covers(grouping, keys)
    # What is missing, as boxes: exactly the uncovered elements.
    missing, count = coverage.missing(10_000)
    holes = [torch.zeros(s, dtype=torch.bool) for s in SHAPES]
    for t, box in missing:
        assert not holes[t][tuple(slice(a, b) for a, b in box)].any()  # disjoint
        holes[t][tuple(slice(a, b) for a, b in box)] = True
    assert count == len(missing)
    assert all(torch.equal(h, ~m) for h, m in zip(holes, masks))
    # Retention: a holder touches holes of the others iff it has an element only it holds.
    for i, k in enumerate(keys):
        others = Coverage(grouping)
        for j, other in enumerate(keys):
            if j != i:
                others.add(other)
        rest = _masks([h for j, h in enumerate(holders) if j != i])
        own = _masks([holders[i]])
        assert others.touches_holes(k) == any(bool((o & ~r).any()) for o, r in zip(own, rest))
    # The covering prefix: the fewest holders in order after the first.
    if keys:
        got = covering_prefix(grouping, keys[:1], keys[1:])
        want = next((p for p in range(len(keys)) if all(bool(m.all()) for m in _masks(holders[:1 + p]))), None)
        assert got == want


def test_alike_tensors_share_a_group_until_a_holder_cuts_them_differently():
    shapes = Shapes.of(MANIFEST)
    grouping = Grouping(shapes)
    assert grouping.count == 3  # (6, 4) x3, (5,), (3, 2, 2)
    rows = check_held(MANIFEST, [(0, Region.of((6, 4), rows=(0, 3))), (1, Region.of((6, 4), rows=(0, 3))),
                                 (4, Region.of((6, 4), rows=(0, 3)))])
    grouping.refine(rows)
    assert grouping.count == 3 and len(set(grouping.of[[0, 1, 4]].tolist())) == 1  # held alike: still one group
    grouping.refine(check_held(MANIFEST, [(1, Region.of((6, 4), cols=(0, 2)))]))
    assert grouping.count == 4 and grouping.of[1] != grouping.of[0] == grouping.of[4]


def test_tensors_held_in_alike_sets_of_regions_share_a_group():
    """A trainer's cut holds each tensor it owns in its readers' boxes, the same
    boxes for every tensor of a shape: one group, not one per tensor."""
    shapes = Shapes.of(MANIFEST)
    halves = [Region.of((6, 4), cols=(0, 2)), Region.of((6, 4), cols=(2, 4))]
    grouping = Grouping(shapes)
    grouping.refine(check_held(MANIFEST, [(t, r) for t in (0, 1, 4) for r in halves]))
    assert grouping.count == 3 and len(set(grouping.of[[0, 1, 4]].tolist())) == 1
    other = [Region.of((6, 4), cols=(0, 1)), Region.of((6, 4), cols=(1, 4))]  # a set of as many regions, not alike
    grouping.refine(check_held(MANIFEST, [(0, halves[0]), (0, halves[1]), (1, other[0]), (1, other[1]),
                                          (4, halves[1]), (4, halves[0])]))
    assert grouping.count == 4 and grouping.of[1] != grouping.of[0] == grouping.of[4]
    # The cut covers all it holds, group by group.
    coverage = Coverage(grouping)
    coverage.add(HolderKeys(check_held(MANIFEST, [(t, r) for t in (0, 1, 4) for r in halves]), grouping))
    missing, _ = coverage.missing(100)
    assert {t for t, _ in missing} == {2, 3}


def test_a_table_of_rules_for_256_ranks_is_covered_by_all_of_them_and_no_fewer():
    shapes = Shapes.of(Manifest(tuple(TensorSpec(f"w{i}", "bfloat16", (7168 if i % 2 else 576, 64), 0)
                                      for i in range(1000))))
    from tensorhub.regiontable import chunk_bounds, table_of_rules
    grouping = Grouping(shapes)
    tables = []
    dim0 = shapes.dims[:, 0]
    for r in range(256):
        start, stop = chunk_bounds(dim0, np.full_like(dim0, 256), np.full_like(dim0, r))
        tables.append(table_of_rules([(0, 256, r)], (start < stop).astype(np.uint8), shapes))
        grouping.refine(tables[-1])
    keys = [HolderKeys(t, grouping) for t in tables]
    assert covering_prefix(grouping, [], keys) == 256
    assert not covers(grouping, keys[:255])
    assert isinstance(tables[0], RegionTable)
