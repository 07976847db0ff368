"""Failures a client can act on, in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

The openai client raises only on a body with the ``error`` key, and retries 429 and 5xx by itself
(honouring ``Retry-After``), so the status code and the body both matter.
"""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist; this server serves {served!r}.", param="model",
                    code="model_not_found")


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def queue_full(retry_after_s: int) -> APIError:
    return APIError(429, "The server's queue is full; retry later.", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def loading() -> APIError:
    return APIError(503, "The model is still loading; retry shortly.", type="server_error", code="model_loading",
                    headers={"Retry-After": "1"})


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def shutting_down() -> APIError:
    """A request the server ends (or refuses) because it is stopping (SIGINT, SIGTERM)."""
    return APIError(503, "The server is shutting down; this request was not finished.", type="server_error",
                    code="server_shutting_down")
