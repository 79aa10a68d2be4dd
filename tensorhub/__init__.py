"""TensorHub: Reference-Oriented Storage for model weights.

A reference server records which processes hold which version of a model (or
which regions of it); readers pull the bytes straight out of the holders'
memory with NIXL one-sided READs, and may serve what they received to the next
readers.

Importing this package is cheap and changes nothing in the process: the names
below load on first use, and NIXL/UCX settings apply when a Hub creates its agent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "GroupAnswer": "tensorhub.client.groupanswer",
    "MemberReport": "tensorhub.client.groupanswer",
    "Hub": "tensorhub.client.hub",
    "HubConfig": "tensorhub.client.config",
    "Publication": "tensorhub.client.publication",
    "PullResult": "tensorhub.client.hub",
    "Shard": "tensorhub.shard",
    "Region": "tensorhub.regions",
    "Manifest": "tensorhub.manifest",
    "TensorSpec": "tensorhub.manifest",
    "Labels": "tensorhub.topology",
    "Reliability": "tensorhub.topology",
    **{name: "tensorhub.errors" for name in (
        "AlreadyPublished", "IntegrityError", "InvalidRequest", "ManifestMismatch", "PermissionDenied", "ServerUnavailable",
        "ShareUnusable", "SourceLost", "TensorHubError", "TransferStalled", "TransportUnavailable", "UnpublishTimeout",
        "VersionNotFound",
    )},
}

__all__ = [
    "AlreadyPublished", "GroupAnswer", "Hub", "HubConfig", "IntegrityError", "InvalidRequest", "Labels", "Manifest", "ManifestMismatch",
    "MemberReport", "PermissionDenied", "Publication", "PullResult", "Region", "Reliability", "ServerUnavailable", "Shard", "ShareUnusable", "SourceLost",
    "TensorHubError", "TensorSpec", "TransferStalled", "TransportUnavailable", "UnpublishTimeout", "VersionNotFound", "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorhub' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from tensorhub.client.config import HubConfig
    from tensorhub.client.groupanswer import GroupAnswer, MemberReport
    from tensorhub.client.hub import Hub, PullResult
    from tensorhub.client.publication import Publication
    from tensorhub.errors import (
        AlreadyPublished,
        IntegrityError,
        InvalidRequest,
        ManifestMismatch,
        PermissionDenied,
        ServerUnavailable,
        ShareUnusable,
        SourceLost,
        TensorHubError,
        TransferStalled,
        TransportUnavailable,
        UnpublishTimeout,
        VersionNotFound,
    )
    from tensorhub.manifest import Manifest, TensorSpec
    from tensorhub.regions import Region
    from tensorhub.shard import Shard
    from tensorhub.topology import Labels, Reliability
