"""TensorHub for vLLM: a weight-transfer backend named ``tensorhub`` (registered
by the ``vllm.general_plugins`` entry point) and a worker extension for
frameworks that drive engines through ``collective_rpc``."""

from tensorhub_vllm.plugin import BACKEND, register

__all__ = ["BACKEND", "register"]
