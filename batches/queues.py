"""The Celery queues, named once: read by the settings (task routes), the process launcher
(relay/processes.py), the dispatch module and /metrics. A leaf: it imports nothing, so settings
can read it before Django is set up."""

# Item work: one wake-up message runs items in one of a worker's 8 slots.
ITEM_QUEUE = "batch"
# Control work (sweeping, validation, finalization, retention): never takes an item slot.
CONTROL_QUEUE = "control"
# Anything not routed (Celery's default queue): served by the control worker.
DEFAULT_QUEUE = "default"
QUEUES = (ITEM_QUEUE, CONTROL_QUEUE, DEFAULT_QUEUE)
# Webhook deliveries are none of these: PostgreSQL's pending deliveries are their queue, served by the webhook
# lane process (relay/processes.py `webhooks`, batches/webhooks/lane.py), never by the control worker.

TASK_ROUTES = {
    "batches.tasks.run_items": {"queue": ITEM_QUEUE},
    "batches.tasks.*": {"queue": CONTROL_QUEUE},
    # /metrics' usage rollup (relay/tasks.py).
    "relay.tasks.*": {"queue": CONTROL_QUEUE},
}
