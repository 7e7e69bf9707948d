"""Writes of usage events.

An event is written once per request_id. The unique constraint is the
guard, not a read-then-write: `INSERT … ON CONFLICT DO NOTHING` never raises
on a duplicate, so it is safe under races between replicas and does not
poison a caller's transaction (a batch item records its event in the same
transaction that finishes the item).
"""

from usage.models import UsageEvent
from usage.tokens import Tokens

_ERROR_MESSAGE_MAX = UsageEvent._meta.get_field("error_message").max_length


def record_event(*, tokens: Tokens | None = None, fetch: bool = True, **fields) -> UsageEvent | None:
    """Record the event for `fields["request_id"]`, or return the one already recorded.

    `fields` are UsageEvent fields; `tokens`, when given, fills the four token
    columns. A long upstream error body is cut to fit rather than refused.
    The request paths pass `fetch=False`: they never look at the row again, so
    they skip reading it back (one query less per request and per item).
    """
    if not fields.get("request_id"):
        # "" would be a real key under the unique constraint and swallow every later event.
        raise ValueError("record_event needs a request_id")
    if tokens is not None:
        fields.update(
            input_tokens=tokens.input,
            output_tokens=tokens.output,
            cache_read_tokens=tokens.cache_read,
            cache_write_tokens=tokens.cache_write,
        )
    if "error_message" in fields:
        fields["error_message"] = fields["error_message"][:_ERROR_MESSAGE_MAX]
    event = UsageEvent(**fields)
    UsageEvent.objects.bulk_create([event], ignore_conflicts=True)
    if not fetch:
        return None
    # Either ours or the first writer's; under READ COMMITTED this statement
    # sees a concurrent writer's row once its INSERT waited for it to commit.
    return UsageEvent.objects.get(request_id=event.request_id)
