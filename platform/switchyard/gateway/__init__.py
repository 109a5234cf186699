"""The OpenAI-compatible gateway: the live executor of ``decide``'s decision procedure.

Owns: the ``/v1`` chat and completion routes, authentication (the key cache), the request's run of
the procedure with its effects answered live (``proxy``: classifier scores, the response cache,
admission on the limit store, flow control's queues and yielders in ``flow``, the retry budget,
one try at an endpoint in ``attempt``), what it reads of its fleet (``view``), streaming and
accounting, policy reloads, metrics, traces and the process's activity. Must not touch: decision
logic or its order (``decide`` owns both), SQL (it calls ``store``), the console and the admin API
(``admin``) or the Batch API (``batch``): the composition root (``switchyard.app``) assembles them beside
it, and the errors, OpenAPI pieces and header names they share with it are ``switchyard.api``'s.
"""
