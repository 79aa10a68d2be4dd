"""The reference server: soft state of who holds which version (``state``), its
gRPC front (``service``) and the process that runs it (``app``)."""

from tensorhub.server.app import EmbeddedServer, serve
from tensorhub.server.config import ServerConfig

__all__ = ["EmbeddedServer", "ServerConfig", "serve"]
