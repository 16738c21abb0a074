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
from collections.abc import Mapping

from .errors import AuthenticationError

NONCE_BYTES = 16
MAC_BYTES = 32


def new_token() -> str:
    """A fresh random token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def token_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The shared token the environment gives: ``HOPLITE_TOKEN``, else the contents (stripped) of
    the file ``HOPLITE_TOKEN_FILE`` names (a mounted secret, e.g. ``/run/secrets/hoplite_token``
    in the images of ``docker/``), else ``""``. A named file that is missing is no token; one that
    exists but cannot be read, or is empty, raises :class:`AuthenticationError`."""
    env = os.environ if environ is None else environ
    token = env.get("HOPLITE_TOKEN", "")
    path = env.get("HOPLITE_TOKEN_FILE", "")
    if token or not path or not os.path.exists(path):
        return token
    return read_token_file(path)


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace removed).

    Raises:
        AuthenticationError: the file cannot be read or holds no token.
    """
    try:
        with open(path) as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthenticationError(f"cannot read the token file {path}: {exc}") from exc
    if not token:
        raise AuthenticationError(f"the token file {path} is empty")
    return token


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return os.urandom(NONCE_BYTES)


def mac(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The proof for ``role`` (``b"client"`` or ``b"server"``) over both nonces."""
    return hmac.new(token.encode(), role + b"|" + server_nonce + client_nonce, hashlib.sha256).digest()


def verify(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes, proof: bytes) -> bool:
    """Constant-time check of a proof made by :func:`mac`."""
    return hmac.compare_digest(mac(token, role, server_nonce, client_nonce), bytes(proof))
