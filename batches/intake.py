"""POST /v1/batches: one URL, two surfaces, told apart by the body (design.md §2).

The body is parsed once, as a stream (ingest.read_submission spools the
`requests` elements); the top-level keys then say which surface it speaks:

- `shape` → Relay-native (spec 000), stored by services.store_native;
- `endpoint`, `completion_window`, `input_file_id` or `metadata` → OpenAI-compatible
  (spec 003), created by openai_batches.create;
- neither → native, whose own checks answer "shape is required";
- both → 400: the caller must mean one or the other.
"""

from django.conf import settings

from batches import ingest
from batches.errors import invalid
from batches.models import Surface

OPENAI_MARKERS = ("endpoint", "completion_window", "input_file_id", "metadata")


def read(raw_stream) -> ingest.Submission:
    return ingest.read_submission(raw_stream, ingest.body_limit(), settings.RELAY_BATCH_MAX_ITEMS)


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
