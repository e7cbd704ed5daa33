"""TLS for every gRPC listener and channel: file locations in settings, credentials built here.

Settings classes inherit `TlsSettings`, so every service has the same four knobs
(PDSERVE_TLS_CERT_FILE, PDSERVE_TLS_KEY_FILE, PDSERVE_TLS_CA_FILE, PDSERVE_TLS_CLIENT_AUTH,
PDSERVE_TLS_SERVER_NAME). TLS is on when a certificate and key are given; then servers listen
with TLS and clients verify peers against the CA bundle. With tls_client_auth, servers also
require client certificates and clients present theirs (mutual TLS between services).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from shared.settings import field


@dataclass(frozen=True)
class TlsSettings:
    """TLS settings shared by every service (mixed into each service's settings dataclass)."""

    tls_cert_file: str = field("", "PEM certificate of this service (TLS is on when set with the key)")
    tls_key_file: str = field("", "PEM private key of this service")
    tls_ca_file: str = field("", "PEM CA bundle that peers' certificates are checked against")
    tls_client_auth: bool = field(False, "require and present client certificates (mutual TLS)")
    tls_server_name: str = field("", "name expected in peers' certificates (default: the host dialed)")
    cluster_token: str = field(
        "",
        "shared secret every internal RPC must carry (x-pdserve-cluster-token metadata); the same "
        "on every service of the cluster; empty = no check (with mutual TLS the certificate is "
        "the identity)",
        secret=True,
    )

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert_file and self.tls_key_file)

    def tls_config(self) -> TlsConfig | None:
        if not self.tls_enabled:
            if self.tls_cert_file or self.tls_key_file:
                raise ValueError("TLS needs both tls_cert_file and tls_key_file")
            return None
        return TlsConfig(
            cert_pem=_read(self.tls_cert_file, "tls_cert_file"),
            key_pem=_read(self.tls_key_file, "tls_key_file"),
            ca_pem=_read(self.tls_ca_file, "tls_ca_file") if self.tls_ca_file else None,
            client_auth=self.tls_client_auth,
            server_name=self.tls_server_name,
        )


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class TlsConfig:
    """Loaded PEM material (read once at start-up)."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes | None
    client_auth: bool
    server_name: str

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.client_auth and self.ca_pem is None:
            raise ValueError("tls_client_auth needs tls_ca_file to check client certificates")
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem if self.client_auth else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if self.client_auth:
            return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)
        return grpc.ssl_channel_credentials(self.ca_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
