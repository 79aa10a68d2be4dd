"""FP8 rollouts from a bf16 trainer: a TP=2 engine started with an online FP8
quantization (``quantization="fp8_per_channel"``) pulls bf16 versions through
the tensorhub backend, and vLLM's layer-wise reload, which our apply runs,
re-quantizes them.

Engine B starts (fresh) on the perturbed weights, then engine A on the
original ones; what each generates and holds at start is the reference. A updated to
the perturbed version must then generate what B generates and hold B's
quantized weights and scales bit for bit; A updated back to the original must
return exactly to what it was at start (no stale scale survives a reload).
Row-parallel per-channel quantization all-reduces its amax across the TP group
while each layer is rebuilt, so a worker that rebuilt layers in another order
than its peer would hang here rather than pass.

The other online methods run where vLLM has their kernels; on a CPU without
AMX they skip, naming vLLM's own reason."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from conftest import greedy_many, perturbed_copy, tp_engine, update

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
METHODS = ["fp8_per_channel", "fp8_per_tensor", "fp8_per_block"]


def unsupported(method: str) -> str | None:
    """Why this platform cannot start an engine with ``method``, asked of vLLM
    (its ops registry and kernel checks), or None where it can."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or method == "fp8_per_channel":  # per-channel: torch's _scaled_mm on CPU
        return None
    if method == "fp8_per_tensor":
        import vllm._custom_ops  # noqa: F401  registers the _C ops

        # its weights are quantized by ops.scaled_fp8_quant with a static scale
        if not torch._C._dispatch_has_kernel_for_dispatch_key("_C::static_scaled_fp8_quant", "CPU"):
            return "this vLLM build has no CPU kernel for _C::static_scaled_fp8_quant (fp8_per_tensor's weight quant)"
        return None
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    supported, why = CPUFp8BlockScaledMMKernel.is_supported()
    return None if supported else f"vLLM's CPU block-FP8 kernel: {why}"


def quantized_state(model: torch.nn.Module) -> dict[str, tuple[str, list[int], str, bool]]:
    """Runs in each worker (``apply_model``): every parameter and buffer of the
    live model as (dtype, shape, SHA-256 of its bytes, all finite), so two
    engines compare bit for bit without shipping the tensors."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().contiguous().reshape(-1)
        finite = bool(torch.isfinite(data.float()).all()) if data.is_floating_point() else True
        digest = hashlib.sha256(data.view(torch.uint8).cpu().numpy()).hexdigest()
        out[name] = (str(t.dtype), list(t.shape), digest, finite)
    return out


def snapshot(llm) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens and every worker's ``quantized_state``."""
    return greedy_many(llm, PROMPTS), llm.apply_model(quantized_state)


@pytest.fixture(scope="module")
def perturbed_model(tiny_model, tmp_path_factory):
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-qwen2-perturbed"))


@pytest.fixture(scope="module")
def functions_to_workers():
    """``apply_model`` hands ``quantized_state`` to the engine core, which takes
    it as pickle only with VLLM_ALLOW_INSECURE_SERIALIZATION (read by the engine
    processes at start). It travels by reference: vLLM spawns its processes with
    this one's ``sys.path``, so they import this module to find it."""
    import vllm.envs

    old = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    vllm.envs.disable_envs_cache()
    yield
    if old is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old


@pytest.mark.parametrize("method", METHODS)
def test_bf16_versions_requantize_as_a_fresh_engine(method, tp_env, functions_to_workers, tiny_model,
                                                    perturbed_model, hub_server, trainer):
    reason = unsupported(method)
    if reason:
        pytest.skip(reason)
    # One engine at a time: a second engine's workers spinning beside the first's
    # starved the reference server on two cores (a worker's registration missed
    # its deadline). B's part is its fresh state, taken before A starts.
    b = tp_engine(perturbed_model, hub_server.address, quantization=method)
    try:
        fresh_perturbed = snapshot(b)
    finally:
        stop(b)
    a = tp_engine(tiny_model, hub_server.address, quantization=method)
    try:
        fresh_original = snapshot(a)
        tokens, states = fresh_original
        assert len(states) == 2
        for state, other in zip(states, fresh_perturbed[1]):  # A's and B's worker k
            # the engine really serves FP8: a check that could pass on bf16 would prove nothing
            fp8 = [n for n, (dtype, *_) in state.items() if dtype == "torch.float8_e4m3fn"]
            assert any(n.endswith("mlp.down_proj.weight") for n in fp8), sorted(state)
            scales = [n for n in state if "scale" in n.rsplit(".", 1)[-1]]
            assert scales and all(state[n][3] for n in scales), scales  # set, and no NaN/inf
            # the two versions differ in tokens and in every quantized weight, so the equalities below mean something
            assert all(state[n][2] != other[n][2] for n in fp8)
        assert tokens != fresh_perturbed[0]

        trainer.publish(71, "perturbed")  # bf16, as the trainer holds it
        update(a, 71, "71")
        updated_tokens, updated_states = snapshot(a)
        assert updated_tokens == fresh_perturbed[0]  # token for token
        for rank, (got, want) in enumerate(zip(updated_states, fresh_perturbed[1])):
            differ = sorted(n for n in want if got.get(n) != want[n])
            assert not differ and got.keys() == want.keys(), (rank, differ[:8])
        trainer.unpublish(71)

        trainer.publish(72, "original")
        update(a, 72, "72")
        assert snapshot(a) == fresh_original  # A -> B -> A: exactly A, tokens, weights and scales
        trainer.unpublish(72)
    finally:
        stop(a)


def stop(llm) -> None:
    """Shut an engine down now (its worker processes too), not when it is collected."""
    llm.shutdown_weight_transfer_engine()
    llm.llm_engine.engine_core.shutdown()
