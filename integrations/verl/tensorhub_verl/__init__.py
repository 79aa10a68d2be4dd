"""TensorHub for verl: the checkpoint engine ``tensorhub``.

``import verl`` loads ``tensorhub_verl.engine`` through the ``verl.plugins``
entry point, which registers the backend with verl's CheckpointEngineRegistry.
This package itself imports nothing from verl, so it stays cheap to import.
"""

from tensorhub_verl.config import TensorHubEngineConfig

__all__ = ["TensorHubEngineConfig"]
