"""The OpenAI Batch API: files, batch jobs, and the worker that runs their lines in idle capacity.

Owns: the ``/v1/files`` and ``/v1/batches`` routes (``api``), authenticated with the same API keys as
the chat routes and scoped to the key's tenant; a new batch's intake (``intake``: its parameters and
every line of its input file checked, the errors OpenAI's shape); the worker (``worker``) that
dispatches lines through the gateway's batch lane. The files, jobs and lines themselves, and every
state change of them, are the store's (``store.files``, ``store.batches``, ``store.batch_queue``,
``store.batch_finalize``).
Must not touch: the policy, or the interactive lane's queues; the tables other than through those
store modules.
"""
