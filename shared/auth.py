"""API keys: which keys a service accepts and the one check both public faces use (the gRPC
interceptor in `shared.grpc_auth` and the gateway's HTTP API). No grpc here.

A request carries `authorization: Bearer <key>` (HTTP header or gRPC metadata). Keys are compared
in constant time (hmac.compare_digest against every configured key, no early exit) and are never
logged or shown in an error message.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

BEARER = "bearer"
AUTH_HEADER = "authorization"  # lower case: gRPC metadata keys and ASGI header names are lower case


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys; empty means authentication is off."""

    _keys: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        checked = []
        for i, key in enumerate(keys):
            key = key.strip()
            if not key:
                continue
            if not all("!" <= ch <= "~" for ch in key):
                # Never echo the key: say which one (by position) and what is wrong with it.
                raise ValueError(f"API key #{i + 1} has a space or a non-printable/non-ASCII character")
            checked.append(key.encode("ascii"))
        return cls(tuple(dict.fromkeys(checked)))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def accepts(self, authorization: str | None) -> bool:
        """True when authentication is off, or `authorization` is "Bearer <one of the keys>"."""
        if not self._keys:
            return True
        presented = bearer_token(authorization)
        if presented is None:
            return False
        try:
            candidate = presented.encode("ascii")
        except UnicodeEncodeError:
            return False
        ok = False
        for key in self._keys:  # every key is compared: timing does not depend on which matched
            ok |= hmac.compare_digest(key, candidate)
        return ok


def bearer_token(authorization: str | None) -> str | None:
    """The token of an "Authorization: Bearer <token>" value (scheme case-insensitive), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        return None
    return token.strip()


def read_key_file(path: str) -> list[str]:
    """Keys from a file: one per line; blank lines and lines starting with '#' are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"api_key_file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from exc
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"api_key_file {path} holds no key (one key per line)")
    return keys


def load_api_keys(keys: Iterable[str], key_file: str = "") -> ApiKeys:
    """Keys given directly (flags / PDSERVE_API_KEYS) plus those in `key_file` (if set)."""
    return ApiKeys.of([*keys, *(read_key_file(key_file) if key_file else [])])


UNAUTHENTICATED_MESSAGE = (
    "missing or invalid API key: send 'authorization: Bearer <key>' with one of the keys this "
    "gateway was started with (--api-key / PDSERVE_API_KEYS / --api-key-file)"
)
