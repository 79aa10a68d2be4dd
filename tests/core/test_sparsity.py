"""tensorhub.bench.sparsity: weight versions from real AdamW steps, and the
fraction of bf16 elements whose bits change between them."""

from __future__ import annotations

import pytest
import torch

from tensorhub.bench.sparsity import (
    TinyLM,
    changed_by_tensor,
    changed_fraction,
    load_versions,
    save_versions,
    shape_for_bytes,
    state_bytes,
    trained_versions,
)

TARGET = 1 << 20


@pytest.fixture(scope="module")
def versions() -> dict[float, list[dict[str, torch.Tensor]]]:
    return {lr: trained_versions(target_bytes=TARGET, lr=lr, steps=2) for lr in (1e-5, 1e-3)}


def test_versions_are_bf16_with_the_same_names_and_shapes(versions):
    for vs in versions.values():
        assert len(vs) == 3
        first = vs[0]
        for v in vs:
            assert v.keys() == first.keys()
            for name, t in v.items():
                assert t.dtype == torch.bfloat16 and t.is_contiguous() and not t.requires_grad
                assert t.shape == first[name].shape
    # The same seed gives the same start whatever the learning rate.
    assert changed_fraction(versions[1e-5][0], versions[1e-3][0]) == 0.0


def test_parameter_bytes_near_the_target(versions):
    got = state_bytes(versions[1e-5][0])
    assert abs(got - TARGET) <= 0.25 * TARGET
    s = shape_for_bytes(TARGET)
    assert got == 2 * TinyLM.count(s["vocab"], s["hidden"], s["layers"], s["ffn"])


def test_a_small_lr_changes_some_weights_and_a_larger_one_more(versions):
    small = [changed_fraction(a, b) for a, b in zip(versions[1e-5], versions[1e-5][1:])]
    large = [changed_fraction(a, b) for a, b in zip(versions[1e-3], versions[1e-3][1:])]
    print(f"changed fraction at lr 1e-5: {small}, at lr 1e-3: {large}")
    assert all(0.0 < f < 1.0 for f in small)
    assert all(lg > sm for sm, lg in zip(small, large))
    v = versions[1e-5]
    assert changed_fraction(v[1], v[1]) == 0.0
    per = changed_by_tensor(v[0], v[1])
    assert per.keys() == v[0].keys() and all(0.0 <= f <= 1.0 for f in per.values())
    # Norm weights start at 1.0, whose half ulp (2**-8) a 1e-5 step cannot reach.
    assert all(f == 0.0 for name, f in per.items() if "norm" in name)


def test_fraction_counts_bits_for_any_element_size():
    old = {"b": torch.tensor([0.0, 1.0], dtype=torch.bfloat16), "u8": torch.tensor([1, 2], dtype=torch.uint8),
           "f32": torch.tensor([0.0, 2.0]), "i64": torch.tensor([5, 6])}
    new = {"b": torch.tensor([-0.0, 1.0], dtype=torch.bfloat16), "u8": torch.tensor([1, 2], dtype=torch.uint8),
           "f32": torch.tensor([0.0, 2.0]), "i64": torch.tensor([5, 7])}
    assert changed_fraction(old, new) == 2 / 8  # -0.0 differs from 0.0 in its bits
    assert changed_by_tensor(old, new) == {"b": 0.5, "u8": 0.0, "f32": 0.0, "i64": 0.5}
    with pytest.raises(ValueError):
        changed_fraction(old, {**new, "b": torch.zeros(3, dtype=torch.bfloat16)})


def test_save_load_round_trips_bit_exactly(versions, tmp_path):
    path = tmp_path / "versions.pt"
    save_versions(path, versions[1e-5])
    back = load_versions(path)
    assert len(back) == len(versions[1e-5])
    for a, b in zip(versions[1e-5], back):
        assert a.keys() == b.keys()
        assert all(b[n].dtype == torch.bfloat16 and torch.equal(a[n].view(torch.int16), b[n].view(torch.int16))
                   for n in a)
