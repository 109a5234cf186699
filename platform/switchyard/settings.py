"""Settings: one frozen pydantic-settings class, read from ``SWITCHYARD_*`` variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Everything a gateway process is configured with; built once and passed in."""

    model_config = SettingsConfigDict(
        env_prefix="SWITCHYARD_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    data_dir: Path = Field(default=Path(".switchyard"), description="Where embedded state lives.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: a SQLite file in data_dir."
    )
    redis_url: str | None = Field(default=None, description="Unset: in-process state.")
    redis_key_prefix: str = Field(
        default="sy:", min_length=1, max_length=64,
        description="Prepended to every Redis key: deployments sharing one Redis keep apart.",
    )
    policy_file: Path = Field(default=Path("policies.yaml"))
    policy_source: Literal["file", "db"] = "file"
    host: str = "127.0.0.1"
    workers: int = Field(default=1, ge=1, description="Gateway processes `switchyard serve` runs on its port.")
    port: int = Field(default=8400, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    log_format: Literal["text", "json"] = Field(
        default="text", description="text: one readable line per record; json: one JSON object per line with "
        "the request id of the request being served (see switchyard.logs).")
    otlp_traces_endpoint: str | None = Field(
        default=None, description="OTLP/HTTP endpoint for request traces, e.g. http://otel-collector:4318/v1/traces "
        "(needs the otel extra); unset: no tracing.")
    otel_service_name: str = Field(default="switchyard", description="service.name of the exported spans.")
    request_log: bool = Field(default=True, description="Keep finished requests in the database's request "
                              "log (shown by the console across replicas).")
    request_log_sample_rate: float = Field(default=1.0, ge=0, le=1, description="Share of successful requests "
                                           "kept in the request log (every other outcome is kept).")
    request_log_retention_days: float = Field(default=7.0, gt=0, description="How long request-log rows are kept.")
    request_log_flush_interval_s: float = Field(default=1.0, gt=0, description="How often the request log is "
                                                "written.")
    log_requests: bool = Field(default=False, description="One INFO line per finished request (logger "
                               "switchyard.requests): id, tenant, tier, models, pool, status, outcome, timings.")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0, description="Largest request body.")
    batch_max_file_bytes: int = Field(
        default=100 * 1024 * 1024, gt=0, description="Largest file uploaded to /v1/files (its own limit: "
        "max_body_bytes does not apply there).",
    )
    max_json_depth: int = Field(
        default=64, ge=2, le=512, description="Deepest nesting of arrays and objects in a request body; deeper "
        "is a 400 (invalid_request_error, code json_too_deep).",
    )
    max_messages: int = Field(default=2048, gt=0, description="Most messages in one chat request; more is a 400.")
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="Largest request head (request line and headers); a larger one "
        "is answered 431 and its connection closed.",
    )
    client_header_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest a client may take to send a request's head, from its connection "
        "(or the first byte of its next request on a kept-alive one); then 408 and the connection is closed.",
    )
    client_body_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest a client may pause while sending a request body (a batch upload "
        "too); then 408 and the connection is closed.",
    )
    client_keepalive_timeout_s: int = Field(
        default=75, gt=0, description="How long an idle kept-alive client connection stays open (longer than the "
        "60 s idle timeout of common load balancers, so that they close first).",
    )
    upstream_connect_timeout_s: float = Field(default=3.0, gt=0)
    upstream_read_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest silence from an upstream before a 504."
    )
    upstream_max_connections: int = Field(default=1000, gt=0)
    upstream_max_response_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Largest complete (non-streamed) answer read from an engine; "
        "a larger one is a 502 upstream_invalid_response that counts against the engine.",
    )
    upstream_max_event_bytes: int = Field(
        default=16 * 1024 * 1024, gt=0, description="Largest single SSE event of a streamed answer; a larger one "
        "ends the stream with an error event and counts against the engine.",
    )
    key_cache_ttl_s: float = Field(
        default=5.0, ge=0, description="How long a key lookup is trusted at most: revocations and tenant changes "
        "made through Switchyard reach every process at its next request regardless (gateway/auth.py).",
    )
    scrape_interval_s: float = Field(
        default=1.0, gt=0, description="How often each engine's /metrics is read for load signals."
    )
    flow_control: bool = Field(
        default=True,
        description="The gateway's priority queues, deadlines, shedding and downgrades. Off: every request goes "
        "straight to the engines (which still get a `priority` where the pool has `priority_scheduling`).",
    )
    picker: Literal["prefix-aware", "least-loaded", "round-robin"] = Field(
        default="prefix-aware",
        description="Endpoint picking: each model's endpoint profile (Switchyard's load-, prefix- and "
        "region-aware scoring), or a baseline for benchmarks.",
    )
    region: str | None = Field(
        default=None, pattern=r"^[a-z][a-z0-9_-]{0,62}$",
        description="The region this gateway runs in: the home region of requests whose header, key and "
        "tenant name none. Unset: such requests prefer no region.",
    )
    policy_poll_interval_s: float = Field(
        default=0.5, gt=0, description="How often the active policy version (and in file mode the file) is "
        "checked, besides PostgreSQL's LISTEN/NOTIFY and the file watch.",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token for the admin API (/admin/api); unset: the admin API "
        "answers 403 (the console, with its own logins, works either way).",
    )
    stall_sampler_ms: float | None = Field(
        default=None, gt=0, description="Diagnostics: log where the event loop's thread was each time the loop "
        "ran this many ms late (a watchdog thread; one warning line per stall; see `gateway/stalls.py`). Unset: off.",
    )
    usage_flush_interval_s: float = Field(
        default=2.0, gt=0, description="How often the usage ledger's counts are written to the database.",
    )
    batch_worker: bool = Field(
        default=True, description="Run a batch worker in this process (see also `switchyard worker`).",
    )
    batch_concurrency: int | None = Field(
        default=None, gt=0, description="Batch lines one worker keeps in flight. Unset: enough to fill every pool's "
        "sequence slots and its batch waiting room, from the policy in force (at most 1,024).")
    batch_lease_s: float = Field(
        default=60.0, gt=0, description="How long a claimed batch line stays a worker's without being renewed "
        "(a crashed worker's lines are claimed again after this).",
    )
    batch_max_attempts: int = Field(default=5, gt=0, description="Tries of a batch line before it fails.")
    console_secret: SecretStr | None = Field(
        default=None, description="Signs the console's CSRF tokens; every replica needs the same one. Unset: "
        "a random secret is made once and kept in <data_dir>/console-secret.",
    )
    console_session_ttl_s: float = Field(default=12 * 3600, gt=0, description="How long a console login lasts.")
    password_hash_profile: Literal["rfc9106-low-memory", "rfc9106-high-memory", "cheapest"] = Field(
        default="rfc9106-low-memory", description="The argon2id parameters console passwords are hashed with: "
        "RFC 9106's low-memory profile (64 MiB, 3 passes, about 0.1 s a hash), its high-memory one (2 GiB, 1 pass), "
        "or argon2-cffi's cheapest (for test suites only). A login with a password hashed under other parameters "
        "stores it again under these.",
    )
    console_secure_cookies: bool | None = Field(
        default=None, description="Mark console cookies Secure. Unset: when the request came over https "
        "(directly or as X-Forwarded-Proto from a proxy that terminates TLS).",
    )
    console_login_attempts: int = Field(
        default=5, gt=0, description="Failed logins allowed per username and per client address in "
        "console_login_window_s; more are refused with 429 until the window has passed.",
    )
    console_login_window_s: float = Field(default=300.0, gt=0)
    console_oidc_issuer: str | None = Field(
        default=None, description="Console sign-in through the organisation's identity provider (OpenID Connect): "
        "its issuer URL, as its discovery document (<issuer>/.well-known/openid-configuration) names it. Unset: "
        "local users only. Local users keep working beside it.",
    )
    console_oidc_client_id: str | None = Field(default=None, description="This console's client id at the provider.")
    console_oidc_client_secret: SecretStr | None = Field(
        default=None, description="The client's secret (a confidential client: client_secret_basic or "
        "client_secret_post, as the provider supports). Unset: a public client (PKCE only).",
    )
    console_oidc_scopes: str = Field(default="openid profile email", description="Scopes asked for (openid is "
                                     "always added).")
    console_oidc_role_claim: str = Field(
        default="groups", description="The claim the console role is read from: a string or a list of strings, "
        "a dotted path for nested claims (realm_access.roles). Read from the ID token, else from the userinfo "
        "endpoint.",
    )
    console_oidc_roles: dict[str, Literal["viewer", "operator", "admin"]] = Field(
        default_factory=dict, description="The role claim's values and the console role each gives, as JSON "
        '(SWITCHYARD_CONSOLE_OIDC_ROLES=\'{"gateway-admins": "admin", "sre": "operator"}\'); a user with '
        "several gets the highest. Empty: a value that names a role (viewer, operator, admin) is that role.",
    )
    console_oidc_default_role: Literal["viewer", "operator", "admin"] | None = Field(
        default=None, description="The role of a user whose claim maps to none. Unset: such a user is refused.",
    )
    console_oidc_username_claim: str = Field(
        default="preferred_username", description="The claim that names the console user (then email, then "
        "sub, when it is absent).",
    )
    console_oidc_label: str = Field(default="single sign-on", description="The login page's button: "
                                    "'Sign in with <label>'.")
    console_oidc_redirect_url: str | None = Field(
        default=None, description="The callback URL registered at the provider "
        "(https://<host>/admin/login/oidc/callback). Unset: made from the request's own URL.",
    )

    @model_validator(mode="after")
    def _oidc_whole(self) -> Settings:
        if (self.console_oidc_issuer is None) != (self.console_oidc_client_id is None):
            raise ValueError("console_oidc_issuer and console_oidc_client_id are set together (or neither)")
        if self.console_oidc_issuer is not None and not self.console_oidc_issuer.startswith(("https://", "http://")):
            raise ValueError("console_oidc_issuer is an http(s) URL")
        return self

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to ``sqlite:///<data_dir>/switchyard.db``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'switchyard.db').resolve()}"

    @property
    def listen(self) -> str:
        """``host:port`` as printed in messages."""
        return f"{self.host}:{self.port}"
