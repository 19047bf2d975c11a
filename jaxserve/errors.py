"""Errors a caller can act on; the server maps them to HTTP statuses."""


class InvalidRequestError(ValueError):
    """A request the engine will not run; `param` names the offending field (HTTP 400)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
