"""Typed errors. Each message names the model, version and source involved and
says what the caller can do about it."""

from __future__ import annotations


class TensorHubError(Exception):
    """Base class of every error TensorHub raises on purpose."""


class ServerUnavailable(TensorHubError):
    """The reference server could not be reached before the deadline."""

    def __init__(self, address: str, detail: str = "", *, maybe_applied: bool = True) -> None:
        self.address = address
        # False when the request never left this process (no connection): the
        # server cannot have acted on it. Otherwise only the answer may be lost.
        self.maybe_applied = maybe_applied
        super().__init__(
            f"reference server at {address} is unavailable ({detail or 'no answer'}); "
            "check that `tensorhub server` runs there and the address is right"
        )


class TransportUnavailable(TensorHubError):
    """This process could not start its NIXL agent (the UCX backend found no
    usable network device or transport). Nothing was registered or sent."""

    def __init__(self, agent: str, detail: str) -> None:
        self.agent = agent
        super().__init__(
            f"NIXL agent {agent!r} could not start its UCX backend ({detail}); check that the network "
            "device in UCX_NET_DEVICES is up and UCX_TLS names a transport this host has, then connect again"
        )


class InvalidRequest(TensorHubError, ValueError):
    """The server rejected a request as malformed (INVALID_ARGUMENT)."""


class VersionNotFound(TensorHubError, LookupError):
    """No complete replica of the requested version is held anywhere."""

    def __init__(self, model: str, version: int | str, detail: str = "") -> None:
        self.model = model
        self.version = version
        super().__init__(
            detail
            or f"model {model!r} has no pullable version {version!r}; "
            "publish it first or call hub.versions(model) to see what is held"
        )


class AlreadyPublished(TensorHubError):
    """A replica of (model, version) exists with another manifest, or twice."""


class ManifestMismatch(TensorHubError, ValueError):
    """The destination tensors do not match the version's manifest. Raised before
    any byte moves."""


class SourceLost(TensorHubError):
    """Every source that held the bytes a pull still needed was lost
    (process died, link cut, or the transfer stalled past its deadline)."""

    def __init__(self, model: str, version: int, sources: list[str], detail: str) -> None:
        self.model = model
        self.version = version
        self.sources = sources
        super().__init__(
            f"pull of {model!r} version {version} lost its source(s) "
            f"{', '.join(sources) or '(none)'}: {detail}; no other holder has the "
            "missing chunks: retry once another replica is published, or pull another version"
        )


class TransferStalled(SourceLost):
    """A chunk read made no progress before the reader's own deadline."""


class UnpublishTimeout(TensorHubError):
    """Readers still held leases on a replica when unpublish's timeout ran out.
    The replica is withdrawn; the memory must not be reused yet."""


class PermissionDenied(TensorHubError, PermissionError):
    """The reference server refused the call: this client lacks the server's
    token (UNAUTHENTICATED), or touched what belongs to another agent
    (PERMISSION_DENIED). Nothing was changed."""


class ShareUnusable(TensorHubError):
    """A group answer another member resolved (``Hub.resolve_for_group``) names
    what this process never saw (a holder's layout or memory, the manifest):
    its history differs from the resolving member's. Nothing was read; it
    resolves on its own instead."""


class IntegrityError(SourceLost):
    """Bytes read from a source did not match the checksums its publisher
    computed (memory corrupted, or stale bytes after reuse), and no other holder
    had good ones. Every such source was reported and excluded; no corrupted
    chunk was served to other readers."""
