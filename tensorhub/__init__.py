"""TensorHub: Reference-Oriented Storage for model weights.

A reference server records which processes hold which version of a model;
readers pull the bytes straight out of the holders' memory with NIXL one-sided
READs, and may serve what they received to the next readers.
"""

from tensorhub.client import Hub, HubConfig, Publication, PullResult
from tensorhub.errors import (
    AlreadyPublished,
    InvalidRequest,
    ManifestMismatch,
    ServerUnavailable,
    SourceLost,
    TensorHubError,
    TransferStalled,
    UnpublishTimeout,
    VersionNotFound,
)
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.topology import Labels, Reliability

__version__ = "0.1.0"

__all__ = [
    "AlreadyPublished", "Hub", "HubConfig", "InvalidRequest", "Labels", "Manifest", "ManifestMismatch",
    "Publication", "PullResult", "Reliability", "ServerUnavailable", "SourceLost", "TensorHubError",
    "TensorSpec", "TransferStalled", "UnpublishTimeout", "VersionNotFound", "__version__",
]
