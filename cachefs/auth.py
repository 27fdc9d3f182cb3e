"""The cluster token on the wire: one gRPC metadata key, shared by every caller and the master."""

from __future__ import annotations

TOKEN_METADATA = "x-cachefs-token"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that carries ``token`` (none when there is no token)."""
    return ((TOKEN_METADATA, token),) if token else ()
