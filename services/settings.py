"""Service configuration shared by every Podium service (pydantic-settings).

Values come from constructor arguments, then ``PODIUM_*`` environment variables, then a
``.env`` file; ``REDIS_URL`` is read without prefix because that is what every Redis host sets.
Secrets (the API token) can also be read from a file, as Kubernetes mounts Secrets.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class PodiumSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PODIUM_", env_file=".env", extra="ignore")

    data_dir: Path = Field(
        default=Path("data"), description="Where embedded Redis, blobs and logs are kept."
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("PODIUM_REDIS_URL", "REDIS_URL", "redis_url"),
        description="External Redis; when unset an embedded private Redis runs under data_dir.",
    )
    api_token: SecretStr | None = Field(
        default=None, description="Bearer token for /api/v1; PODIUM_API_TOKEN."
    )
    api_token_file: Path | None = Field(
        default=None, description="File holding the token (a mounted Kubernetes Secret)."
    )

    # Bounds on slow and idle clients, enforced by services.http_server for every service (see
    # docs/reliability.md): without them a few hundred idle or trickling connections take every
    # file descriptor and the service accepts no one.
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request head must arrive whole within this many seconds of the "
        "connection opening (or of the previous response); else 408 and closed.",
    )
    http_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for the next bytes of a request body the server is reading; "
        "else 408 and closed.",
    )
    http_min_body_rate: int = Field(
        default=1024,
        ge=0,
        description="Bytes/s a request body must average once it has taken longer than "
        "http_body_timeout_s (0: no minimum).",
    )
    http_keep_alive_s: float = Field(
        default=5.0, gt=0, description="An idle keep-alive connection is closed after this."
    )
    http_max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Client connections per service; one more closes the one waiting longest "
        "for a request, or is answered 503. Unset: a quarter of the open-file limit, at most "
        "4,096.",
    )
    http_max_header_bytes: int = Field(
        default=64 << 10, ge=1024, description="Largest request head (line and headers), 431."
    )
    http_send_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest a client may leave an answer unread (the server's writes stalled) "
        "without reading a byte of it; else the connection is closed.",
    )
    http_min_send_rate: int = Field(
        default=1024,
        ge=0,
        description="Bytes/s a client must read an answer at once the server's writes have "
        "been stalled longer than http_send_timeout_s (0: no minimum).",
    )
    http_max_pipelined: int = Field(
        default=16,
        ge=1,
        description="Requests a client may pipeline on one connection ahead of their answers; "
        "the connection is closed after the last of them is answered.",
    )

    def token(self) -> str | None:
        """The API token, or None when none is configured (an open, local-only API)."""
        return read_secret(self.api_token, self.api_token_file, "PODIUM_API_TOKEN")


def read_secret(value: SecretStr | None, path: Path | None, variable: str) -> str | None:
    """A secret given as a value or as a file (a mounted Kubernetes Secret); None if neither.

    A secret that is set but empty (an unset variable rendered into a Secret, an empty file) is
    a configuration error, not "no auth": it raises instead of opening what it protects.
    """
    if value is not None:
        secret, source = value.get_secret_value().strip(), variable
    elif path is not None:
        secret, source = path.read_text().strip(), str(path)
    else:
        return None
    if not secret:
        raise ValueError(f"the {variable} from {source} is empty; set a token or unset it")
    return secret
