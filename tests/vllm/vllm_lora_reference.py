"""What fresh engines generate with LoRA adapters loaded from PEFT files on
disk (vLLM's own path): the references of test_vllm_lora.py. Run in its own
process, because shutting an in-process engine down tears down vLLM's global
parallel state, which the engines of the test process still use.

    python vllm_lora_reference.py SPEC.json   -> prints {"tag": [[token, ...] per prompt], ...}

SPEC: {"engine_args": {...}, "prompts": [...], "max_tokens": N,
       "engines": [{"model": DIR, "runs": {"tag": PEFT_DIR or null}, "engine_args": {...}}]}
An engine's own ``engine_args`` (optional) go over the spec's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(Path(sys.argv[1]).read_text())
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    out = {}
    lora_id = 0
    for engine in spec["engines"]:
        llm = LLM(model=engine["model"], **{**spec["engine_args"], **engine.get("engine_args", {})})
        for tag, peft in engine["runs"].items():
            lora_id += 1
            lora = None if peft is None else LoRARequest(f"disk-{tag}", lora_id, peft)
            outs = llm.generate(spec["prompts"], params, lora_request=lora, use_tqdm=False)
            out[tag] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    print("REFERENCE " + json.dumps(out), flush=True)
