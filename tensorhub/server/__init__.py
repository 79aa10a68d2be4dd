"""The reference server: soft state of who holds which version (``state``), its
gRPC front (``service``) and the process that runs it (``app``)."""

from tensorhub.server.app import EmbeddedServer, serve

__all__ = ["EmbeddedServer", "serve"]
