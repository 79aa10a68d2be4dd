"""``tensorhub bench rl --lora-rank R`` (issue #50): the base is frozen and
reaches the rollouts once, and each step the trainer's link carries only
adapter bytes: in TensorHub's run what the rollouts read from it (about one
adapter where they relay), while the broadcast baseline sends it to every
rollout. The run is real (processes, gloo, NIXL, a reference server) on
emulated hosts, whose link counters are the trainer's egress."""

from __future__ import annotations

import json

import pytest

from tensorhub import netns
from tensorhub.bench.rl import lora
from tensorhub.bench.rl.config import compose


def test_the_adapter_is_an_all_linear_lora_of_the_decoder_that_fills_the_base():
    cfg = compose(["size=16GiB", "lora_layers=36", "lora_rank=32"])
    h = lora.hidden(cfg.size, cfg.lora_layers)
    assert h == 4544 and h % 64 == 0
    shapes = lora.shapes(cfg.size, cfg.lora_layers, cfg.lora_rank)
    assert len(shapes) == 36 * 7 * 2  # A and B of q/k/v/o/gate/up/down in every layer
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] == (h // 4, 32)
    assert shapes["base_model.model.model.layers.35.mlp.down_proj.lora_A.weight"] == (32, 3 * h)
    # about 1% of the base, as an all-linear rank-32 adapter of Qwen3-8B is
    assert 0.009 < lora.adapter_bytes(cfg) / cfg.size < 0.013
    assert lora.version_bytes(cfg) == lora.adapter_bytes(cfg) > lora.matrix_bytes(cfg)
    assert lora.version_bytes(compose(["size=64MiB"])) == 64 << 20  # LoRA mode off: a step makes a whole version


@pytest.mark.parametrize("overrides, message", [
    (["scenario=crossdc", "lora_rank=8"], "not crossdc"),
    (["lora_rank=8", "delta=true"], "no delta"),
    (["lora_rank=-1"], "lora_rank >= 0"),
])
def test_lora_mode_refuses_what_it_does_not_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_the_flag_is_the_key():
    from tensorhub.bench.rl.cli import overrides
    from tensorhub.cli import parse_args

    assert "lora_rank=16" in overrides(parse_args(["bench", "rl", "--lora-rank", "16"]))


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_the_trainer_sends_about_one_adapter_per_step_not_the_base(tmp_path):
    from tensorhub import cli

    out = tmp_path / "rl"
    assert cli.main(["bench", "rl", "--no-live", "--readers", "2", "--size", "16MiB", "--lora-rank", "8",
                     "steps=2", "step_s=0.3", "gen_median_s=0.3", f"out={out}"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "rl-standalone.json").read_text())["results"]}
    adapter = lora.adapter_bytes(compose(["size=16MiB", "lora_rank=8"]))
    assert adapter < (16 << 20) // 10
    ours, base = rows["tensorhub"], rows["broadcast"]
    for row in (ours, base):
        assert row["adapter_bytes"] == adapter and row["params"]["lora_rank"] == 8
        # the rollouts received adapters only during the run (the base came before it)
        assert row["bytes_received"] <= 2 * 2 * adapter
    # The trainer's link carried the adapter versions the rollouts read from it
    # (the pulls' own count) and little more: no base (16x an adapter). A rollout
    # reads from its peer what the peer holds; one that starts while the peer is
    # mid-pull reads the rest from the trainer: at most an adapter per rollout.
    assert adapter <= ours["trainer_egress_bytes"] <= 1.15 * ours["bytes_from_trainer"]
    assert ours["bytes_from_trainer"] <= 2 * 2 * adapter and ours["egress_per_step_vs_adapter"] <= 2 * 1.15
    # gloo's broadcast sends the adapter to each of the 2 rollouts
    assert 1.5 <= base["egress_per_step_vs_adapter"] <= 2 * 1.15
    assert "trainer sent / step (adapters)" in (out / "rl-standalone.md").read_text()


@pytest.mark.timeout(120)
def test_elastic_joiners_load_the_base_and_the_newest_adapter(tmp_path):
    """A replacement joins mid-run: it needs the base (which the others pulled
    before the run) and the newest adapter, from the trainer (p2p) or from
    whoever holds them (tensorhub). One host, no link caps: no egress counters."""
    from tensorhub import cli

    out = tmp_path / "rl"
    assert cli.main(["bench", "rl", "--no-live", "--hosts", "local", "--scenario", "elastic", "--readers", "2",
                     "--size", "8MiB", "--lora-rank", "4", "steps=2", "step_s=0.5", "gen_median_s=0.3", "spot=1",
                     "wave=1", "waves=1", "replace_after_s=0.3", f"out={out}"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "rl-elastic.json").read_text())["results"]}
    adapter = lora.matrix_bytes(compose(["size=8MiB", "lora_rank=4"]))
    for method, row in rows.items():
        assert row["joins"] == 1 and row["timeline"]["r0#1"][-1][1] == 2, method  # the joiner holds the last
        # during the run: the joiner's base and adapters, never another base
        assert (8 << 20) + adapter <= row["bytes_received"] < 2 * (8 << 20), method
    assert rows["p2p"]["bytes_from_rollouts"] == 0  # p2p: everything from the trainer
