"""Registration, configuration parsing and the group guarantee, without an engine."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from conftest import MODEL_KEY
from tensorhub_vllm.config import TensorHubInitInfo, TensorHubUpdateInfo
from tensorhub_vllm.receiver import VersionReceiver, checkpoint_layout

from tensorhub import Hub, ManifestMismatch


def test_entry_point_registers_backend_idempotently():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (ep,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "tensorhub"]
    register = ep.load()
    register()
    register()  # vLLM loads plugins in every process, sometimes twice
    from vllm.config.weight_transfer import WeightTransferConfig

    engine_cls = WeightTransferEngineFactory._registry["tensorhub"]()
    assert engine_cls.__name__ == "TensorHubWeightTransferEngine"
    assert WeightTransferConfig(backend="tensorhub").backend == "tensorhub"


@pytest.mark.parametrize(("values", "message"), [
    ({"model": "m"}, r"TensorHubInitInfo\.hub: is required"),
    ({"hub": "h:1", "model": ""}, r"TensorHubInitInfo\.model: must be a non-empty string"),
    ({"hub": "h:1", "model": "m", "serve": "yes"}, r"TensorHubInitInfo\.serve: must be true or false"),
    ({"hub": "h:1", "model": "m", "unpublish_timeout_s": 0}, r"TensorHubInitInfo\.unpublish_timeout_s"),
    ({"hub": "h:1", "model": "m", "overread": 1.5}, r"TensorHubInitInfo\.overread: must be a number from 0 to 1"),
    ({"hub": "h:1", "model": "m", "hub_config": {"read_wrkers": 2}}, r"TensorHubInitInfo\.hub_config: .*read_wrkers"),
    ({"hub": "h:1", "model": "m", "modle": "x"}, r"TensorHubInitInfo has no field\(s\) \['modle'\]"),
    ({"hub": "h:1", "model": "m", "merge_adapter": "m/lora", "serve": False},
     r"TensorHubInitInfo\.merge_adapter: needs serve: true"),
    ({"hub": "h:1", "model": "m", "merge_adapter": "m"}, r"TensorHubInitInfo\.merge_adapter: must be the adapter's"),
    ("h:1", r"TensorHubInitInfo must be a dict"),
])
def test_bad_init_info_names_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        TensorHubInitInfo.from_dict(values)


def test_init_and_update_info_parse():
    info = TensorHubInitInfo.from_dict({"hub": "127.0.0.1:1", "model": "m", "hub_config": {"read_workers": 4}})
    assert (info.serve, info.hub_config, info.overread) == (True, {"read_workers": 4}, 0.2)
    assert TensorHubInitInfo.from_dict({"hub": "h:1", "model": "m", "overread": 0}).overread == 0.0
    assert TensorHubUpdateInfo.from_dict({}).version == "latest"
    assert TensorHubUpdateInfo.from_dict({"version": 3}).version == 3
    for bad in (-1, "3", True, 1.5):
        with pytest.raises(ValueError, match=r"TensorHubUpdateInfo\.version"):
            TensorHubUpdateInfo.from_dict({"version": bad})


def test_extension_methods_do_not_clash_with_worker_attributes():
    from tensorhub_vllm.extension import TensorHubWorkerExtension
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    ours = {n for n in vars(TensorHubWorkerExtension) if not n.startswith("__")}
    # An engine started earlier in this session mixes the extension into the
    # worker class itself: look at every other class of the workers' MROs.
    theirs = {n for cls in CPUWorker.__mro__ + Worker.__mro__ if cls is not TensorHubWorkerExtension for n in vars(cls)}
    assert ours and not ours & theirs


def test_group_members_receive_the_same_version(hub_server, tiny_model):
    """Two workers of one engine (same group, same round) get the version the
    first one fixed, even if a newer one appeared in between."""
    layout = checkpoint_layout(tiny_model, torch.bfloat16)
    info = TensorHubInitInfo(hub=hub_server.address, model=MODEL_KEY + "-group", serve=False)
    with Hub.connect(hub_server.address, name="unit-trainer") as trainer:
        weights = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in layout.items()}
        newer = {n: torch.ones(t.shape, dtype=t.dtype) for n, t in layout.items()}
        trainer.publish(info.model, 1, weights)
        ranks = [VersionReceiver(info, layout, group="engine-a", name=f"rank{r}") for r in range(2)]
        try:
            assert ranks[0].receive("latest").version == 1
            trainer.publish(info.model, 2, newer)
            assert ranks[1].receive("latest").version == 1  # same round: the first request fixed it
            assert [r.receive("latest").version for r in ranks] == [2, 2]  # next round
        finally:
            for r in ranks:
                r.close()


def test_receiver_without_serving_checks_the_layout(hub_server, tiny_model):
    """serve=False pulls into fresh memory: the layout check happens after the
    bytes arrived, still before anything could be applied."""
    layout = checkpoint_layout(tiny_model, torch.bfloat16)
    info = TensorHubInitInfo(hub=hub_server.address, model=MODEL_KEY + "-noserve", serve=False)
    wrong = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in layout.items()}
    with Hub.connect(hub_server.address, name="unit-trainer") as trainer:
        trainer.publish(info.model, 1, wrong)
        receiver = VersionReceiver(info, layout, group="engine-b", name="rank0")
        try:
            with pytest.raises(ManifestMismatch, match="version has float32"):
                receiver.receive(1)
        finally:
            receiver.close()


def test_trainer_side_registers_with_vllms_trainer_factory():
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo, TensorHubTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    assert WeightTransferTrainerFactory._registry["tensorhub"]() is TensorHubTrainerWeightTransferEngine
    info = TensorHubTrainerInitInfo(hub="127.0.0.1:1", model="m", rank=0)
    assert (info.backend, info.is_sender, info.first_version) == ("tensorhub", True, 1)
    with pytest.raises(ValueError, match="needs source="):
        WeightTransferTrainerFactory.trainer_init(info, client=None, source=None)


@pytest.mark.parametrize(("values", "message"), [
    ({"cut": "reader"}, r"TensorHubTrainerInitInfo\.cut: must be 'readers' or None, not 'reader'"),
    ({"cut": "readers", "cut_gather_bytes": 0}, r"TensorHubTrainerInitInfo\.cut_gather_bytes: must be a positive"),
    ({"cut": "readers", "cut_gather_bytes": True}, r"TensorHubTrainerInitInfo\.cut_gather_bytes: must be a positive"),
    ({"cut_gather_bytes": 1 << 20}, r"TensorHubTrainerInitInfo\.cut_gather_bytes: only means something with cut"),
])
def test_bad_trainer_cut_settings_name_the_field(values, message):
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo

    assert TensorHubTrainerInitInfo(hub="h:1", model="m", rank=0).cut is None  # off by default
    with pytest.raises(ValueError, match=message):
        TensorHubTrainerInitInfo(hub="h:1", model="m", rank=0, **values)


def test_the_trainer_cut_needs_a_process_group():
    """``cut="readers"`` gathers over the default process group: without one,
    trainer_init refuses (naming the field) before it connects anywhere."""
    import torch.distributed as dist
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.cut: 'readers' gathers over the default"):
        WeightTransferTrainerFactory.trainer_init(
            TensorHubTrainerInitInfo(hub="127.0.0.1:1", model="m", rank=0, cut="readers"), client=None,
            source=ModuleSource(torch.nn.Linear(2, 2)))


def test_publish_together_names_the_field_when_it_cannot_be():
    """``publish_together=True`` announces over the default process group:
    without one, trainer_init refuses before it connects; with ``lora`` (each
    rank's adapter alone) and a non-bool, the init info itself does."""
    import torch.distributed as dist
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.publish_together: the ranks publish as the "
                                         r"default torch\.distributed group, and none is initialized"):
        WeightTransferTrainerFactory.trainer_init(
            TensorHubTrainerInitInfo(hub="127.0.0.1:1", model="m", rank=0, publish_together=True), client=None,
            source=ModuleSource(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.publish_together: an adapter version"):
        TensorHubTrainerInitInfo(hub="h:1", model="m", rank=0, publish_together=True, lora=True)
    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.publish_together: must be True or False"):
        TensorHubTrainerInitInfo(hub="h:1", model="m", rank=0, publish_together="yes")


def test_moe_updates_with_eplb_are_refused_at_init():
    """EPLB moves experts between workers at run time: the read set of init would
    go stale. Stand-ins for the layer and the config, because vLLM builds MoE
    layers only inside an engine and refuses EPLB on CPU (tests/vllm/test_vllm_moe.py
    runs real MoE engines)."""
    from types import SimpleNamespace

    from tensorhub_vllm.vllm_internals import check_moe_updatable
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = object.__new__(UnquantizedFusedMoEMethod)  # an nn.Module, left uninitialized: set plainly
    object.__setattr__(method, "moe_kernel", None)  # as before its first finalize: no experts of its own yet
    layer = torch.nn.Module()
    object.__setattr__(layer, "quant_method", method)
    model = torch.nn.Sequential(layer)
    check_moe_updatable(model, SimpleNamespace(enable_eplb=False))
    with pytest.raises(RuntimeError, match="enable_eplb"):
        check_moe_updatable(model, SimpleNamespace(enable_eplb=True))
    check_moe_updatable(torch.nn.Sequential(torch.nn.Linear(2, 2)), SimpleNamespace(enable_eplb=True))  # no MoE
