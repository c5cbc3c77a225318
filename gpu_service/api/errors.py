"""The API's error type and OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers  # e.g. Retry-After on a 429


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def check_prompt_chars(n: int, max_chars: int | None, param: str) -> None:
    """Refuse a prompt of more than `max_chars` characters before it is tokenized (--max-prompt-chars)."""
    if max_chars is not None and n > max_chars:
        raise APIError(400, f"the prompt has {n} characters; this server takes at most {max_chars} "
                            f"(--max-prompt-chars); shorten it", param=param, code="context_length_exceeded")
