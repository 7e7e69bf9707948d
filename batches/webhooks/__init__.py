"""Signed webhooks when a batch ends (docs/webhooks.md): OpenAI's Webhook Endpoints API, Standard Webhooks
signatures, an outbox written with the batch's final move and delivered by the webhook lane — a process of its
own, never the control worker.

Rooms, bottom up (a module imports only those below it):

    models.py      endpoints, events, deliveries (with their lease), attempts
    events.py      the event types and bodies per surface                      (batches.surfaces.registry)
    signing.py     secrets and Standard Webhooks signatures                    (stdlib)
    guard.py       where a delivery may go: the SSRF guard of tool executors   (batches.tools.netguard)
    outbox.py      the event rows written inside a batch's final move; wake    (models, events, core.redis)
    delivery.py    claim, one POST, its record, retries, pausing               (outbox, signing, guard)
    housekeeping.py  probes of failing endpoints, retention                    (delivery)
    lane.py        the lane process: fair, capped picks, many POSTs at once    (delivery, housekeeping, outbox)
    selectors.py   reads for the API, the admin and /metrics                   (models)
    services.py    endpoint create/update/delete/rotate/test, resend, pause, resume  (outbox, selectors)
    api/           thin DRF views                                              (services, selectors)

The lifecycle (batches/lifecycle/states.py) imports none of these: this app's ready() registers the outbox
as a hook that `move` calls inside the transaction of every final move.
"""
