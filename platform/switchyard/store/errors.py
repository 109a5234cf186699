"""Errors of the store's services; each message is fit to show an operator as it is."""


class StoreError(Exception):
    """A request to the store could not be carried out; nothing was written."""


class NotFound(StoreError):
    """The named record does not exist."""


class Conflict(StoreError):
    """The change clashes with what is stored (a duplicate name, an already revoked key)."""


class TooLarge(StoreError):
    """A file is larger than allowed."""


class InvalidParam(StoreError):
    """A parameter of a request is invalid; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
