"""LoRA adapters as versions (tensorhub.lora): published with their PEFT
settings beside the matrices, pulled back as both."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Hub
from tensorhub.lora import ADAPTER_CONFIG, AdapterConfig, base_weight_name, merge_lora, publish_adapter, pull_adapter

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": {"v_proj", "q_proj"}, "task_type": "CAUSAL_LM", "bias": "none"}


def adapter(seed: int = 0, r: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(r, 32, generator=g).to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = torch.randn(48, r, generator=g).to(torch.bfloat16)
    return out


class PeftShaped(torch.nn.Module):
    """Named as a PEFT model names its parameters (``lora_A.<adapter>.weight``
    under ``base_model.model``), with a ``peft_config`` mapping, so the
    module path is checked without installing peft."""

    class _Config:
        def to_dict(self):
            return dict(CONFIG)

    def __init__(self) -> None:
        super().__init__()
        self.peft_config = {"default": self._Config()}
        proj = torch.nn.Module()
        proj.base_layer = torch.nn.Linear(32, 48, bias=False)
        proj.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(32, 4, bias=False)})
        proj.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 48, bias=False)})
        inner = torch.nn.Module()
        inner.q_proj = proj
        self.base_model = torch.nn.Module()
        self.base_model.model = inner


def test_adapter_round_trips_with_its_config(server):
    tensors = adapter()
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="rollout") as hub:
        publish_adapter(trainer, "policy/lora/math", 3, tensors, CONFIG)
        got = pull_adapter(hub, "policy/lora/math", "latest")
    assert got.version == 3
    assert got.config == AdapterConfig(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))
    assert got.config.to_peft_dict()["peft_type"] == "LORA"
    assert set(got.tensors) == set(tensors)  # the side tensor is split off
    assert all(torch.equal(got.tensors[n], t) for n, t in tensors.items())
    assert got.result.nbytes == got.nbytes + got.result.tensors[ADAPTER_CONFIG].numel()


def test_parts_read_only_their_boxes_and_come_back_full_shaped(server):
    """A TP worker's pull: a box of some matrices (B's rows, A's columns), the rest whole."""
    tensors = adapter()
    boxes = {n: ((24, 48), (0, 4)) if ".lora_B." in n else ((0, 4), (0, 16)) for n in tensors if ".q_proj." in n}
    asked = []

    def parts(name, shape, dtype):
        asked.append((name, shape, dtype))
        return boxes.get(name)

    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="rollout") as hub:
        publish_adapter(trainer, "policy/lora/tp", 1, tensors, CONFIG)
        got = pull_adapter(hub, "policy/lora/tp", 1, parts=parts)
    assert sorted(asked) == sorted((n, tuple(t.shape), torch.bfloat16) for n, t in tensors.items())  # not the settings
    for name, t in tensors.items():
        assert got.tensors[name].shape == t.shape
        box = boxes.get(name)
        if box is None:
            assert torch.equal(got.tensors[name], t)
            continue
        inside = tuple(slice(a, b) for a, b in box)
        assert torch.equal(got.tensors[name][inside], t[inside])
        outside = torch.ones_like(t, dtype=torch.bool)
        outside[inside] = False
        assert not got.tensors[name][outside].any()  # zeros: never read
    whole = sum(t.numel() * 2 for n, t in tensors.items() if n not in boxes)
    read = sum(4 * 24 * 2 if ".lora_B." in n else 4 * 16 * 2 for n in boxes)
    assert got.result.nbytes == whole + read + got.result.tensors[ADAPTER_CONFIG].numel()


def test_later_versions_published_in_place_replay_the_readers_plans(server):
    """A training loop publishes every step from the same memory; a rollout
    pulls each into the staging it keeps. From the second version on nothing
    about either side's memory is new, so the pull replays its plans (the
    settings tensor too must be the same memory every version: a new one made
    the trainer's layout new, and every pull planned afresh)."""
    tensors = adapter()
    staging: dict = {}
    paths = []
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="rollout") as hub:
        pub = None
        for version in range(1, 5):
            if pub is not None:
                pub.unpublish()
            for name, t in adapter(seed=version).items():
                tensors[name].copy_(t)
            pub = publish_adapter(trainer, "policy/lora/steps", version, tensors, CONFIG)
            got = pull_adapter(hub, "policy/lora/steps", version, staging=staging)
            assert all(torch.equal(got.tensors[n], t) for n, t in tensors.items())
            paths.append((got.result.path, got.result.not_replayed))
        pub.unpublish()
    assert [p for p, _ in paths[1:]] == ["replayed"] * 3, paths


def test_peft_module_publishes_its_live_parameters_under_saved_names(server):
    model = PeftShaped()
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="rollout") as hub:
        pub = publish_adapter(trainer, "policy/lora/peft", 1, model)
        assert pub.tensors["base_model.model.q_proj.lora_A.weight"].data_ptr() == \
            model.base_model.model.q_proj.lora_A["default"].weight.data_ptr()  # in place, not a copy
        got = pull_adapter(hub, "policy/lora/peft", 1)
    assert sorted(got.tensors) == ["base_model.model.q_proj.lora_A.weight", "base_model.model.q_proj.lora_B.weight"]
    assert torch.equal(got.tensors["base_model.model.q_proj.lora_B.weight"],
                       model.base_model.model.q_proj.lora_B["default"].weight.detach())


@pytest.mark.parametrize(("tensors", "config", "match"), [
    (adapter(r=4), {**CONFIG, "r": 8}, "has rank 4, the config says r=8"),
    ({k: v for k, v in adapter().items() if "lora_B" not in k}, CONFIG, "has no partner"),
    ({**adapter(), "model.norm.weight": torch.ones(32)}, CONFIG, "is not a LoRA matrix"),
    (adapter(), {**CONFIG, "lora_alpha": 0}, r"AdapterConfig\.lora_alpha: must be a number > 0"),
    (adapter(), {"r": 4, "lora_alpha": 8}, r"AdapterConfig\.target_modules: is required"),
    (adapter(), {**CONFIG, "bias": "all"}, r"AdapterConfig\.bias"),
    (adapter(), None, "needs its config"),
])
def test_bad_adapter_is_refused_before_publishing(server, tensors, config, match):
    with Hub.connect(server.address, name="trainer") as trainer:
        with pytest.raises(ValueError, match=match) as e:
            publish_adapter(trainer, "policy/lora/bad", 1, tensors, config)
        assert "nothing was published" in str(e.value)
        assert trainer.versions("policy/lora/bad") == []


def test_a_plain_version_is_not_taken_for_an_adapter(server):
    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="rollout") as hub:
        trainer.publish("policy", 1, {"w": torch.ones(4)})
        with pytest.raises(ValueError, match="is not a LoRA adapter"):
            pull_adapter(hub, "policy", 1)


def test_merge_math_is_peft_scaling_rounded_once():
    w = torch.randn(48, 32).to(torch.bfloat16)
    t = adapter()
    a, b = t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], \
        t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    cfg = AdapterConfig.from_dict(CONFIG)
    assert cfg.scale() == 2.0 and AdapterConfig.from_dict({**CONFIG, "use_rslora": True}).scale() == 4.0
    merged = merge_lora(w, a, b, cfg.scale())
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, (w.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16))
    # a box of the weight merges with its rows of B and columns of A: the same bytes as that box of the whole
    assert torch.equal(merge_lora(w[24:, 8:16], a[:, 8:16], b[24:], 2.0), merged[24:, 8:16])
    assert base_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="not a PEFT LoRA matrix name"):
        base_weight_name("model.norm.weight")
    with pytest.raises(ValueError, match="rank_pattern or alpha_pattern"):
        AdapterConfig.from_dict({**CONFIG, "rank_pattern": {"q_proj": 8}}).scale()
