"""The payload store's errors and the one base its result groups share, used by its backends
(batches/storage.py and batches/storage_s3.py): kept apart so that a backend module never imports the
interface that dispatches to it."""

import logging

from core.errors import RelayError

log = logging.getLogger(__name__)


class PayloadMissing(Exception):
    """A payload the row points at is not in the store: the item or file that needs it fails, never silently."""


class FileTooLarge(Exception):
    pass


class PayloadStoreUnavailable(RelayError):
    """The store cannot be reached or refuses the relay (endpoint down, bucket missing, credentials wrong).

    Not a PayloadMissing: nothing is known to be lost, so no item fails for it. A request that needs the
    store answers 503 in its surface's error shape (a RelayError); a worker's item keeps its lease and is
    rescued once it runs out; a control task is retried by the sweeper. The reason goes to the log, for
    operators; the client is told only that the store is unavailable."""

    def __init__(self, reason: str):
        super().__init__(
            503,
            "payload_store_unavailable",
            "The payload store is unavailable; nothing was stored. Try again later.",
            headers={"Retry-After": "5"},
        )
        self.reason = reason

    def __str__(self) -> str:
        return f"payload store unavailable: {self.reason}"


class ResultGroupBase:
    """`with group:` for every store's result group: close() (the group is stored) on success, discard() on
    an error, so a group cut short leaves nothing its callers could point at."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.discard()
