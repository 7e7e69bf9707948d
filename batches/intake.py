"""POST /v1/batches: one URL, two surfaces, told apart by the body (decision 0002).

The body is parsed once, as a stream (ingest.SubmissionReader); the top-level
keys say which surface it speaks:

- `shape` → Relay-native (decision 0003), stored by submit.store_native;
- `endpoint`, `completion_window`, `input_file_id` or `metadata` → OpenAI-compatible
  (decision 0005), created by batches.surfaces.openai.create;
- neither → native, whose own checks answer "shape is required";
- both → 400: the caller must mean one or the other.
"""

from collections.abc import Callable

from django.conf import settings

from batches import ingest
from batches.errors import invalid
from batches.models import Batch, Surface
from batches.surfaces.native import submit

OPENAI_MARKERS = ("endpoint", "completion_window", "input_file_id", "metadata")


def read(raw_stream) -> ingest.Submission:
    """The whole body parsed, its elements spooled (the Anthropic surface, which has one URL of its own)."""
    return ingest.read_submission(raw_stream, ingest.body_limit(), settings.RELAY_BATCH_MAX_ITEMS)


def receive(raw_stream, principal, on_native: Callable[[], None]) -> Batch | ingest.Submission:
    """A native batch stored as its body was read, or the parsed body for the caller to dispatch.

    When the keys before `requests` already say Relay-native (a `shape`, no OpenAI key), the items
    are stored while the body is parsed (submit.store_native_streaming). Otherwise, and when keys
    after `requests` change the picture, the body is spooled and surface_of() decides, as before.
    `on_native` runs when the streamed body turns out native, before the batch's own checks.
    """
    reader = ingest.SubmissionReader(raw_stream, ingest.body_limit(), settings.RELAY_BATCH_MAX_ITEMS)
    head = reader.head()
    if head is not None and not any(k in head for k in OPENAI_MARKERS) and submit.can_stream_native(head):
        try:
            return submit.store_native_streaming(principal, reader, head, on_native)
        except ingest.RequestsAgain:
            # A second `requests` array: what was stored of the first is rolled back, and the body is
            # read on, spooled, from the second (the last one wins, batches.ingest).
            pass
    return reader.spooled()


def surface_of(top: dict) -> str:
    openai = [k for k in OPENAI_MARKERS if k in top]
    if "shape" in top and openai:
        raise invalid(
            f"A batch body has either 'shape' (Relay-native) or 'endpoint'/'completion_window'/'input_file_id' "
            f"(OpenAI-compatible), not both: got 'shape' and {openai[0]!r}.",
            param="shape",
            code="ambiguous_batch_body",
        )
    return Surface.OPENAI if openai else Surface.NATIVE
