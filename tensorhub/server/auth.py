"""Access control of the control plane: a shared token, and optional TLS.

Every RPC carries ``authorization: Bearer <token>`` metadata (the client's
``rpc.py`` adds it). The interceptor checks it before any handler runs, so a
client without the token is refused with UNAUTHENTICATED and its request is
never decoded: it learns nothing about models, versions or agents, and the
refusal reads the same whether the model exists or not.

The token protects the control plane only. The bytes move over NIXL, whose
transports on CPU (UCX shared memory / CMA, TCP) do not check that the memory
read is still registered: see docs/operations/index.md, "Token and TLS", for what that means.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tensorhub.proto.wire import AUTH_METADATA_KEY, AUTH_SCHEME

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
REFUSAL = "missing or wrong token: this reference server requires its shared token"


def check_token(token: str, what: str = "token") -> str:
    """The token, if it can travel as gRPC metadata (printable ASCII, no
    whitespace) and is long enough to resist guessing; ValueError otherwise."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                         "(e.g. `openssl rand -hex 32`)")
    if not all(33 <= ord(c) < 127 for c in token):
        raise ValueError(f"{what} must be printable ASCII without spaces (it travels as gRPC metadata)")
    return token


def read_secret(path: str | Path, what: str) -> str:
    """A token from a file: its content without surrounding whitespace."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} {str(path)!r}: {e}") from None
    return check_token(text.strip(), f"the {what} {str(path)!r}")


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the shared token (UNAUTHENTICATED).

    The comparison takes constant time (``hmac.compare_digest``): how long a
    refusal takes says nothing about how much of the token was right."""

    def __init__(self, token: str) -> None:
        self._expected = (AUTH_SCHEME + check_token(token)).encode()

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        # No deserializer: a refused request's bytes are never parsed.
        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def allows(self, metadata: tuple | None) -> bool:
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self.allows(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        log.info("refused %s: no valid token", handler_call_details.method)
        return self._refuse


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of the server's certificate chain and private key."""

    cert: str
    key: str

    def credentials(self) -> grpc.ServerCredentials:
        try:
            chain, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the TLS certificate or key: {e}") from None
        return grpc.ssl_server_credentials([(key, chain)])
