"""The HTTP surface's shared vocabulary: what the gateway, the admin API and console, and the Batch API
all say the same way.

Owns: the API's exception tree and the handlers that answer it as OpenAI's error object (``errors``),
the OpenAPI document's shared pieces (``openapi``: schema building blocks, the error objects, the
security schemes, the operation classes of ``/v1`` and ``/admin/api`` routes, ``openapi_config``), and
the name of every ``x-switchyard-*`` header (``headers``).

Must not touch: any other switchyard package: it imports nothing of switchyard but itself, so that
``gateway``, ``admin`` and ``batch`` can share it without reaching into one another. ``headers`` is a
leaf (it imports nothing at all) that ``decide`` may read too; ``decide``, ``policy``, ``state`` and
``sim`` import neither ``errors`` nor ``openapi``.
"""
