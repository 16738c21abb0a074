"""Shared-token mutual authentication (HMAC-SHA256 challenge-response).

Both sides prove they know the token without sending it: each side sends a random nonce, and each
answers with ``HMAC(token, role || server_nonce || client_nonce)``. A peer that cannot answer is
dropped before anything it sent is acted on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping

from .errors import AuthenticationError

log = logging.getLogger(__name__)

NONCE_BYTES = 16
MAC_BYTES = 32


#: Fewest characters a token may have, surrounding whitespace removed. The handshake sends
#: ``HMAC(token, nonces)``: whoever sees one handshake (plain TCP, without TLS) can test guesses of
#: the token offline as fast as SHA-256 runs, so the token must not be guessable; 16 characters of
#: :func:`new_token`'s alphabet are 96 bits. Length is no proof of randomness, but it refuses the
#: blank, one-letter and one-word tokens a typo or a placeholder gives. :func:`new_token` makes 43.
MIN_TOKEN_CHARS = 16
#: Most bytes read from a token file (a token is a line; anything longer is not a token file).
MAX_TOKEN_FILE_BYTES = 4096


def new_token() -> str:
    """A fresh random token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def check_token(token: str, source: str) -> str:
    """``token`` with surrounding whitespace removed, once it has at least
    :data:`MIN_TOKEN_CHARS` characters. ``source`` names where it came from, for the error (which
    never shows the token).

    Raises:
        AuthenticationError: the token is shorter.
    """
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthenticationError(
            f"the token from {source} is {len(token)} characters long (surrounding whitespace "
            f"removed); a token needs at least {MIN_TOKEN_CHARS}: make one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def token_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The shared token the environment gives: ``HOPLITE_TOKEN`` (stripped), else the token in the
    file ``HOPLITE_TOKEN_FILE`` names (a mounted secret, e.g. ``/run/secrets/hoplite_token`` in
    the images of ``docker/``; see :func:`read_token_file`), else ``""`` (neither set).

    Raises:
        AuthenticationError: the token is too short (:func:`check_token`), or the named file is
            missing, not a regular file, unreadable, or holds no token.
    """
    env = os.environ if environ is None else environ
    token = env.get("HOPLITE_TOKEN", "")
    if token:
        return check_token(token, "HOPLITE_TOKEN")
    path = env.get("HOPLITE_TOKEN_FILE", "")
    return read_token_file(path) if path else ""


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace removed). Only a regular file is read (a FIFO
    would block start-up until someone writes to it); one that other users may read or write is
    read with a warning, as every local user could then join the cluster.

    Raises:
        AuthenticationError: the file is missing (a named secret that did not arrive: refused,
            never replaced by a generated token), is not a regular file, cannot be read, is larger
            than :data:`MAX_TOKEN_FILE_BYTES`, or holds no token or too short a one.
    """
    try:
        # Non-blocking: opening a FIFO for reading otherwise waits for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise AuthenticationError(f"the token file {path} does not exist") from None
    except OSError as exc:
        raise AuthenticationError(f"cannot read the token file {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthenticationError(f"the token file {path} is not a regular file")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            log.warning(
                "the token file %s may be read or written by every user of this machine (mode %03o): "
                "anyone here can join the cluster with it; chmod 600 it",
                path,
                stat.S_IMODE(st.st_mode),
            )
        raw = b""
        while len(raw) <= MAX_TOKEN_FILE_BYTES:  # one byte more than a token file may hold
            more = os.read(fd, MAX_TOKEN_FILE_BYTES + 1 - len(raw))
            if not more:
                break
            raw += more
        text = raw.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthenticationError(f"cannot read the token file {path}: {exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise AuthenticationError(f"the token file {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    if not text.strip():
        raise AuthenticationError(f"the token file {path} is empty")
    return check_token(text, f"the token file {path}")


def new_nonce() -> bytes:
    """A fresh random nonce."""
    return os.urandom(NONCE_BYTES)


def mac(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The proof for ``role`` (``b"client"`` or ``b"server"``) over both nonces."""
    return hmac.new(token.encode(), role + b"|" + server_nonce + client_nonce, hashlib.sha256).digest()


def verify(token: str, role: bytes, server_nonce: bytes, client_nonce: bytes, proof: bytes) -> bool:
    """Constant-time check of a proof made by :func:`mac`."""
    return hmac.compare_digest(mac(token, role, server_nonce, client_nonce), bytes(proof))
