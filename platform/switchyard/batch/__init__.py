"""The OpenAI Batch API: files, batch jobs, and the worker that runs their lines in idle capacity.

Owns: the ``/v1/files`` and ``/v1/batches`` routes (``api``), authenticated with the same API keys as
the chat routes and scoped to the key's tenant; the worker (``worker``) that dispatches lines through
the gateway's batch lane. The files, jobs and lines themselves, and every state change of them, are
``store.batches``'.
Must not touch: the policy, or the interactive lane's queues; the tables other than through
``store.batches``.
"""
