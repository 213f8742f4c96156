"""Leaderboard service configuration (``PODIUM_*`` environment variables, see PodiumSettings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from services.checkpoint_store import BlobStore, FilesystemBlobStore, S3BlobStore
from services.settings import PodiumSettings, read_secret


class LeaderboardSettings(PodiumSettings):
    host: str = Field(default="127.0.0.1", description="PODIUM_HOST: address uvicorn binds.")
    port: int = Field(default=8001, description="PODIUM_PORT.")
    default_top_k: int = Field(default=16, ge=1, le=10_000, description="K when a PUT omits it.")
    metrics_token: SecretStr | None = Field(
        default=None,
        description="PODIUM_METRICS_TOKEN: the bearer token /metrics requires (Prometheus's "
        "scrape credential; the API token works too). Unset (the default): /metrics is open to "
        "whoever reaches the port, and it names every experiment with its scores.",
    )
    metrics_token_file: Path | None = Field(
        default=None, description="File holding the metrics token (a mounted Kubernetes Secret)."
    )
    metrics_top_ranks: int = Field(
        default=10, ge=1, le=100, description="Ranks exported as gauges (bounds /metrics series)."
    )
    max_upload_bytes: int = Field(
        default=2 << 30, ge=1, description="Largest submission body (all training files), 413."
    )
    redis_max_connections: int = Field(
        default=64, ge=1, description="Redis connections per process (requests queue for one)."
    )
    lease_ttl_s: float = Field(
        default=3600.0, gt=0, description="How long a generated parent's files stay protected."
    )
    gc_interval_s: float = Field(
        default=60.0, gt=0, description="How often unreferenced blobs are collected."
    )
    gc_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="A blob no candidate ever referenced (an interrupted upload) is swept only "
        "after this age.",
    )
    compile_claim_ttl_s: float = Field(
        # Short: the replacement of a pod that died holding the claim waits this long, and a
        # pod that lives past the orchestrator's pod_healthy_after_s (60 s) while it waits
        # resets the crash-loop count.
        default=20.0,
        gt=0,
        le=3600,
        description="How long a pod's claim to compile a program key lasts unless it claims "
        "again (it does every sixth of this while it compiles): a pod that died frees the key "
        "for another one within this time.",
    )
    compile_retry_after_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="How soon, at the latest, a pod waiting for another's compile asks again "
        "(sooner while few wait on the key; the pod adds jitter and backs off).",
    )
    storage: Literal["fs", "s3"] = Field(default="fs", description="Checkpoint store backend.")
    blob_dir: Path | None = Field(
        default=None, description="Filesystem backend root (a PVC mount); data_dir/blobs if unset."
    )
    s3_bucket: str = "podium-checkpoints"
    s3_prefix: str = "blobs/"
    s3_endpoint_url: str | None = Field(default=None, description="MinIO / Ceph endpoint.")
    s3_region: str | None = None
    s3_create_bucket: bool = False

    def metrics_token_value(self) -> str | None:
        return read_secret(self.metrics_token, self.metrics_token_file, "PODIUM_METRICS_TOKEN")

    def blob_store(self) -> BlobStore:
        """The configured backend; S3 credentials come from boto3's chain (AWS_* variables)."""
        if self.storage == "s3":
            return S3BlobStore(
                self.s3_bucket,
                staging_dir=Path(self.data_dir) / "staging",
                prefix=self.s3_prefix,
                endpoint_url=self.s3_endpoint_url,
                region=self.s3_region,
                create_bucket=self.s3_create_bucket,
            )
        return FilesystemBlobStore(self.blob_dir or Path(self.data_dir) / "blobs")
