"""TensorHub for OpenRLHF 0.11: a launcher that runs OpenRLHF's own
``train_ppo_ray`` with every stock flag, but moves weights through TensorHub.

    TENSORHUB_ADDRESS=auto python -m tensorhub_openrlhf.train_ppo_ray <OpenRLHF's flags>

OpenRLHF has no plugin hook, so the launcher swaps in subclasses of its own
actor classes (``actors.py``) before it runs the stock script. Settings come
from the environment (``settings.py``), never from new flags. This package
imports nothing from OpenRLHF at the top, so it stays cheap to import.
"""

from tensorhub_openrlhf.settings import TensorHubSettings

__all__ = ["TensorHubSettings"]
