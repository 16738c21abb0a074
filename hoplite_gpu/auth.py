"""Shared-token mutual authentication (HMAC-SHA256 challenge-response).

Both sides prove they know the token without sending it: each side sends a random nonce, and each
answers with ``HMAC(token, role || server_nonce || client_nonce)``. A peer that cannot answer is
dropped before anything it sent is acted on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

NONCE_BYTES = 16
MAC_BYTES = 32


def new_token() -> str:
    """A fresh random token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return os.urandom(NONCE_BYTES)


def mac(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The proof for ``role`` (``b"client"`` or ``b"server"``) over both nonces."""
    return hmac.new(token.encode(), role + b"|" + server_nonce + client_nonce, hashlib.sha256).digest()


def verify(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes, proof: bytes) -> bool:
    """Constant-time check of a proof made by :func:`mac`."""
    return hmac.compare_digest(mac(token, role, server_nonce, client_nonce), bytes(proof))
