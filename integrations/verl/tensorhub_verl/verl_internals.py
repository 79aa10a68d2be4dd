"""Our one module of verl internals: the trainer's PEFT module, which verl
0.9.1 does not hand a checkpoint engine.

verl's ``ActorRolloutRefWorker.update_weights`` passes a checkpoint engine a
stream of full tensors (``get_per_tensor_param()``), and with LoRA (not
merged) that stream holds the base weights only: the adapter never reaches a
checkpoint engine other than its built-in ``delta_sharded`` one, which alone
gets the training engine. So ``lora: true`` finds the module the way the
calling worker holds it: ``self.actor.engine.module`` (ActorRolloutRefWorker)
or ``self.engine.module`` (TrainingWorker), on the frames that await
``send_weights``. tests/verl/test_verl_lora.py checks that verl's worker still
calls the engine from a method whose ``self`` has these attributes.
"""

from __future__ import annotations

import sys
from types import FrameType

import torch

# Where a verl worker keeps its training engine, as attribute paths from ``self``.
ENGINE_PATHS = (("actor", "engine"), ("engine",))


def _module_of(worker: object) -> torch.nn.Module | None:
    for path in ENGINE_PATHS:
        engine = worker
        for attr in path:
            engine = getattr(engine, attr, None)
        module = getattr(engine, "module", None)
        if isinstance(module, torch.nn.Module):
            # FSDP1 wraps the PEFT model; FSDP2 shards it in place
            return getattr(module, "_fsdp_wrapped_module", module)
    return None


def calling_workers_module(frame: FrameType | None = None) -> torch.nn.Module:
    """The training module of the verl worker on the call stack above ``frame``
    (default: the caller's caller). Raises ValueError when no frame has one."""
    frame = sys._getframe(2) if frame is None else frame
    while frame is not None:
        worker = frame.f_locals.get("self")
        module = None if worker is None else _module_of(worker)
        if module is not None:
            return module
        frame = frame.f_back
    raise ValueError("tensorhub: lora: true publishes the trainer's PEFT adapter, and no verl worker with a "
                     "training engine (self.actor.engine or self.engine) calls send_weights here; set "
                     "TensorHubCheckpointEngine.module to the PEFT model instead")
