"""The client side: ``Hub`` (publish / pull / unpublish), its config, and the
pieces it is built from (``rpc`` for the control path, ``puller`` for pulls)."""

from tensorhub.client.config import HubConfig
from tensorhub.client.hub import Hub, PullResult
from tensorhub.client.publication import Publication

__all__ = ["Hub", "HubConfig", "Publication", "PullResult"]
