"""Operations endpoints: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from switchyard.gateway.runtime import GatewayRuntime
from switchyard.store.db import ping


@get("/healthz", operation_id="healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    """Alive: the process answers."""
    return {"status": "ok"}


@get("/readyz", operation_id="readyz", include_in_schema=False)
async def readyz(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
    """Ready: a policy is loaded and the database answers (503 otherwise, while requests are still served).

    ``dependencies`` tells whether the limit store (Redis) and key lookups currently fall back.
    """
    runtime: GatewayRuntime = request.app.state.runtime
    checks: dict[str, Any] = {}
    snapshot = runtime.policy.snapshot
    checks["policy"] = {"ok": True, "version": snapshot.label, "sha256": snapshot.sha256,
                        "source": runtime.settings.policy_source, **runtime.reloader.describe(),
                        "canary": runtime.canary.describe()}
    holder = runtime.policy
    if holder.last_error is not None:
        checks["policy"]["rejected"] = {"source": holder.error_source,
                                        "errors": [str(i) for i in holder.last_error.issues]}
    try:
        with anyio.fail_after(2):
            await anyio.to_thread.run_sync(ping, runtime.engine, abandon_on_cancel=True)
        checks["database"] = {"ok": True}
    except Exception as exc:  # any failure to answer is "not ready", reported, never raised
        checks["database"] = {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"[:300]}
    ready = all(c["ok"] for c in checks.values())
    # Not checks: while one is down, requests are served or refused as the policy's
    # resilience.dependencies says; readiness follows the database only.
    dependencies = {"limit_store": "unreachable" if runtime.admitter.store_down else "ok",
                    "key_lookups": "failing" if runtime.auth.database_down else "ok"}
    return Response({"status": "ready" if ready else "not ready", "checks": checks, "dependencies": dependencies},
                    status_code=200 if ready else 503)


@get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Prometheus text exposition."""
    runtime: GatewayRuntime = request.app.state.runtime
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


ROUTES = [healthz, readyz, metrics]
