"""The client side: ``Hub`` (the front door) over ``Holdings`` (what this
process publishes) and pulls (``destination``, ``readlayout``, ``puller``);
``rpc`` is the only client module that sees protobuf."""

from tensorhub.client.config import HubConfig
from tensorhub.client.hub import Hub, PullResult
from tensorhub.client.publication import Publication

__all__ = ["Hub", "HubConfig", "Publication", "PullResult"]
