"""Errors of the store's services; each message is fit to show an operator as it is."""


class StoreError(Exception):
    """A request to the store could not be carried out; nothing was written."""


class NotFound(StoreError):
    """The named record does not exist."""


class Conflict(StoreError):
    """The change clashes with what is stored (a duplicate name, an already revoked key)."""
