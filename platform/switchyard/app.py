"""The composition root: ``create_app(settings)`` assembles the whole HTTP app.

It wires the OpenAI-compatible gateway (:mod:`switchyard.gateway`), the Batch API and its worker
(:mod:`switchyard.batch`), the console and the admin API (:mod:`switchyard.admin`), the static files, the
lifespan, the error handlers (:mod:`switchyard.api.errors`), CSRF and the OpenAPI document. It is the one
place that knows all of them, so that none of those packages needs to import another to be assembled.

The console and the admin API are not handed the gateway's runtime: :func:`admin_dependencies` gives
them each piece they use by itself (:mod:`switchyard.admin.dependencies`).
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

import switchyard
from switchyard.admin.api import admin_api_router
from switchyard.admin.console import admin_router, template_globals
from switchyard.admin.dependencies import AdminDependencies
from switchyard.admin.login import login_router
from switchyard.admin.session import console_security_headers, csrf_config
from switchyard.api.errors import ApiError, api_error_handler, http_exception_handler, internal_error_handler
from switchyard.api.openapi import openapi_config
from switchyard.batch import api as batch_api
from switchyard.batch.worker import worker_lifespan
from switchyard.gateway import openai_api, ops
from switchyard.gateway.fast_routes import FastRoutes, GatewayApp
from switchyard.gateway.proxy import Proxy
from switchyard.gateway.runtime import GatewayRuntime
from switchyard.resources import static_dir, templates_dir
from switchyard.settings import Settings


def admin_dependencies(runtime: GatewayRuntime) -> AdminDependencies:
    """What the console and the admin API use of ``runtime``, piece by piece (the policy holder and the
    database engine are read per request: they exist once the lifespan started)."""
    return AdminDependencies(
        settings=runtime.settings, policy=lambda: runtime.policy, db=lambda: runtime.engine,
        activity=runtime.activity, endpoints=runtime.endpoints, engine_caches=runtime.memory.engine_caches,
        cache=runtime.cache, limits=runtime.admitter,
        change_keys=runtime.change_keys, policy_changed=runtime.policy_changed)


def create_app(settings: Settings) -> GatewayApp:
    """The app for ``settings``: gateway, Batch API, console and admin API; nothing is opened until its
    lifespan starts. The hot path's POST routes are answered ahead of Litestar's layers
    (:mod:`switchyard.gateway.fast_routes`), through the same :class:`Proxy`."""
    runtime = GatewayRuntime(settings)
    proxy = Proxy(runtime)
    admin = admin_dependencies(runtime)
    app = GatewayApp(
        route_handlers=[
            *openai_api.ROUTES,
            *batch_api.ROUTES,
            *ops.ROUTES,
            login_router(admin),
            admin_router(admin),
            admin_api_router(admin),
            create_static_files_router(path="/static", directories=[static_dir()], include_in_schema=False),
        ],
        lifespan=[runtime.lifespan, worker_lifespan(runtime, proxy.serve)],
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_exception_handler,
            Exception: internal_error_handler,
        },
        request_max_body_size=settings.max_body_bytes,
        csrf_config=csrf_config(settings),
        before_send=[console_security_headers],
        template_config=TemplateConfig(directory=templates_dir(), engine=JinjaTemplateEngine,
                                       engine_callback=template_globals),
        openapi_config=openapi_config(title="Switchyard", version=switchyard.__version__, path="/openapi"),
        logging_config=None,
        debug=False,
    )
    app.state.runtime = runtime
    app.state.proxy = proxy
    app.serve_fast(FastRoutes(proxy, settings.max_body_bytes))
    return app
