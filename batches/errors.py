"""The batch API's errors, in each surface's own envelope.

OpenAI-compatible surface (and the shared parsers that answer before a surface is known):

`{"error": {"message", "type", "param", "code"}}` — the shape the `openai` SDK
parses into its exceptions. A RelayError raised by shared code (authentication,
the body parser) is re-shaped with `OpenAIError.of()` so a client of this
surface never sees the relay's native envelope.
"""

from core.errors import AnthropicError, RelayError
from core.errors import anthropic_error_type as error_type  # noqa: F401 - the surface reads it here


class OpenAIError(RelayError):
    def __init__(
        self,
        status: int,
        code: str | None,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(status, code or "", message, type=type, headers=headers, param=param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or None}}

    @classmethod
    def of(cls, exc: RelayError) -> "OpenAIError":
        if isinstance(exc, OpenAIError):
            return exc
        return cls(exc.status, exc.code, exc.message, type=exc.type, headers=exc.headers, param=exc.param)


def invalid(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, code, message, param=param)


def missing(param: str) -> OpenAIError:
    return OpenAIError(400, "missing_required_parameter", f"Missing required parameter: '{param}'.", param=param)


def not_found(message: str) -> OpenAIError:
    return OpenAIError(404, None, message)


def no_batch_access() -> OpenAIError:
    # OpenAI answers 404 when the organization has no Batch API access; so do we
    # when the credential's policy has batch access turned off (Policy.batch_enabled).
    return OpenAIError(
        404,
        "batch_access_disabled",
        "The Batch and Files API is not available to this credential: its policy has batch access turned off.",
    )


# --- the Anthropic-compatible surface: {"type": "error", "error": {"type", "message"}} -----------


# AnthropicError and its error types are core.errors' (the live Anthropic routes answer in them too).
def invalid_anthropic(message: str) -> AnthropicError:
    return AnthropicError(400, message)


# --- every surface ------------------------------------------------------------------------------


class BatchBusy(RelayError):
    """The batch's row stayed locked (a long validation) longer than a cancel waits for it: a clear
    503 to retry, in each surface's own envelope, rather than a 500."""

    def __init__(self):
        super().__init__(
            503,
            "batch_busy",
            "The batch is still being validated; retry the cancel shortly.",
            headers={"Retry-After": 5},
        )
