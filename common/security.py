"""TLS / mutual TLS and per-role bearer tokens, shared by kvloopd and its clients."""

from __future__ import annotations

import os
import ssl
from enum import StrEnum
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, model_validator

from kvloop.common.config_files import ReadableFile, read_secret


class Role(StrEnum):
    ADMIN = "admin"  # everything, including DrainWorker
    READ = "read"  # introspection and non-claiming lookups (routers, the CLI)
    PREFILL = "prefill"  # lookups that claim retained blocks
    AGENT = "agent"  # publishes one worker's events over Connect


MIN_TOKEN_LENGTH = 16


class TokenGrant(BaseModel):
    """What one bearer token may do. The token is given inline or read from a file of its own
    (``token_file``, e.g. a systemd credential), never both."""

    model_config = ConfigDict(extra="forbid")
    token: str = ""
    token_file: ReadableFile | None = None
    role: Role
    # Agent tokens may be bound to one worker id: that agent may publish only for it.
    worker_id: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TokenGrant:
        if self.token_file is not None:
            if self.token:
                raise ValueError("give token or token_file, not both")
            self.token = read_secret(self.token_file)
            where = f"the token in {self.token_file}"
        elif not self.token:
            raise ValueError("token or token_file is required")
        else:
            where = "token"
        # the message names the length rule, never the token
        if len(self.token) < MIN_TOKEN_LENGTH:
            raise ValueError(f"{where} is shorter than {MIN_TOKEN_LENGTH} characters")
        return self


class TlsSettings(BaseModel):
    """Server TLS: certificate + key; a client CA turns on mutual TLS (client certs required)."""

    model_config = ConfigDict(extra="forbid")
    cert_file: ReadableFile
    key_file: ReadableFile
    client_ca_file: ReadableFile | None = None

    @model_validator(mode="after")
    def _usable(self) -> TlsSettings:
        """The certificate and key are PEM and belong together, and the CA parses: checked now, so a
        bad file is a configuration error rather than a failure once the port binds."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # an encrypted key fails here instead of prompting for its passphrase
            context.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        except ssl.SSLError as exc:
            raise ValueError(
                f"cert_file {self.cert_file} and key_file {self.key_file} are not a PEM certificate and "
                f"its private key ({exc.reason or exc})"
            ) from None
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(self.client_ca_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"client_ca_file {self.client_ca_file} is not a PEM CA certificate ({exc.reason or exc})"
                ) from None
        return self

    def http_server_context(self) -> ssl.SSLContext:
        """The same settings for an HTTPS endpoint (a client CA makes client certificates required).

        Unreadable or mismatched files raise ValueError naming them."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                context.load_verify_locations(self.client_ca_file)
                context.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot use the TLS files (cert {self.cert_file}, key {self.key_file}, client CA "
                f"{self.client_ca_file}): {exc}"
            ) from None
        return context

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


class ClientSecurity(BaseModel):
    """How a client reaches kvloopd: optional TLS (server CA, client cert for mTLS) and a token."""

    model_config = ConfigDict(extra="forbid")
    token: str | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @model_validator(mode="after")
    def _pair(self) -> ClientSecurity:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("client cert_file and key_file go together (mutual TLS)")
        return self

    @classmethod
    def from_env(cls, prefix: str = "KVLOOP_") -> ClientSecurity:
        """KVLOOP_TOKEN, KVLOOP_CA_FILE, KVLOOP_CERT_FILE, KVLOOP_KEY_FILE (unset ones stay off)."""

        def env(key: str) -> str | None:
            return os.environ.get(f"{prefix}{key.upper()}") or None

        files = {
            key: Path(value) if (value := env(key)) else None for key in ("ca_file", "cert_file", "key_file")
        }
        return cls(token=env("token"), **files)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            private_key=self.key_file.read_bytes() if self.key_file else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file else None,
        )

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
