"""Where each record of a new batch runs, decided as it is stored: in the relay's workers (`available`), or
at the provider's batch API (`delegated`, in a ProviderJob opened here, sent by batches/provider/jobs.py).

The binding the record routes to decides (`HostBinding.batch_mode`): `relay` (the default) keeps it here;
`provider` and `auto` send it when it can go, and keep it here with a note saying why when it cannot:

- `tool_config`: the record needs the relay between its model turns (`openrelay.tool_config`);
- `endpoint`: the provider's batch API does not take its endpoint;
- `no_batch_api`: the host's kind has no batch API the relay speaks (the Gemini API's takes only Gemini's own
  request shape); later (batches/provider/jobs.py) also a server that answered 404/405 on its batch paths;
- `batch_unready`: the host is not set up for batch jobs (a Bedrock host without a bucket and a role);
- `below_min_records`: the binding's job would carry fewer records than its API takes (Bedrock: 100);
- (later, batches/provider/jobs.py, auto mode) `provider_capacity` and `provider_expired`.

The batch API is the one the host's kind names (wire.for_host), never picked by comparing a kind's name.

A record that does not route (unknown model, no grant, no key) stays in the relay, where it fails exactly as
it would have. The native surface always runs in the relay (the native contract: "Relay runs every item itself").
"""

import logging
from dataclasses import dataclass

import uuid6
from django.conf import settings
from django.db import transaction

from batches import dispatch
from batches.lifecycle import delegated
from batches.models import Batch, ItemState, Surface
from batches.provider.models import JobStatus, ProviderJob
from batches.tools import config as tools_config
from core import catalog
from core.errors import RelayError
from core.models import BatchMode, HostBinding
from gateway import batch_apis as wire
from gateway import routing
from policies import selectors as policy_selectors

log = logging.getLogger(__name__)

NOTE_TOOL_CONFIG = "tool_config"
NOTE_ENDPOINT = "endpoint"
NOTE_CAPACITY = "provider_capacity"
NOTE_EXPIRED = "provider_expired"
NOTE_CATALOG_CHANGED = "catalog_changed"  # the record no longer routes to the job's binding
NOTE_NO_BATCH_API = "no_batch_api"  # the host has no batch API the relay speaks
NOTE_UNREADY = "batch_unready"  # the host is not set up for batch jobs
NOTE_MIN_RECORDS = "below_min_records"  # too few records for the provider to take a job
# Every note an item's `placement` may hold (the admin's filter lists these).
NOTES = (
    NOTE_TOOL_CONFIG,
    NOTE_ENDPOINT,
    NOTE_CAPACITY,
    NOTE_EXPIRED,
    NOTE_CATALOG_CHANGED,
    NOTE_NO_BATCH_API,
    NOTE_UNREADY,
    NOTE_MIN_RECORDS,
)


@dataclass(frozen=True)
class Placement:
    """A record's first state, its job (when delegated) and the note saying why it is not at the provider."""

    state: str
    job_id: object = None
    note: str = ""


class Planner:
    """Places the records of one new batch, in order, opening jobs as they fill (one per binding until it
    reaches the provider's limits). Call `place()` per record, then `save()` inside the transaction that
    inserts the items (the items name their jobs; the foreign key is checked at commit)."""

    def __init__(self, batch: Batch, endpoint: str):
        self.batch = batch
        self.endpoint = endpoint
        self.snapshot = catalog.held()
        self.policy = None
        # Nothing to decide unless some binding sends batches to its provider (one indexed look).
        active = HostBinding.objects.filter(enabled=True).exclude(batch_mode=BatchMode.RELAY).exists()
        if active and batch.surface != Surface.NATIVE and batch.policy_id:
            self.policy = policy_selectors.policy(batch.policy_id, self.snapshot)
        self.routes: dict = {}  # model name → Route or None
        self.open: dict = {}  # binding id → the job filling up
        self.jobs: list[ProviderJob] = []
        self.apis: dict = {}  # (host id, adapter) → its batch API or None
        self.minimum: dict = {}  # job id → the fewest records its API takes
        self.delegated = 0

    @property
    def may_query(self) -> bool:
        """Whether `place` may use the database (routing a model it has not seen): a caller feeding a
        streamed COPY must then produce its rows outside of it."""
        return self.policy is not None

    def place(self, body: dict, size: int) -> Placement | None:
        """None: the record runs in the relay like any other (the binding says so, or nothing routes it)."""
        if self.policy is None:
            return None
        route = self._route(body.get("model"))
        if route is None or route.binding.batch_mode == BatchMode.RELAY:
            return None
        api = self._api(route)
        if api is None:
            return Placement(ItemState.AVAILABLE, note=NOTE_NO_BATCH_API)
        if api.unready(route.host):
            return Placement(ItemState.AVAILABLE, note=NOTE_UNREADY)
        if self.endpoint not in api.endpoints:
            return Placement(ItemState.AVAILABLE, note=NOTE_ENDPOINT)
        if self.endpoint == "/v1/chat/completions" and _has_tool_config(body):
            return Placement(ItemState.AVAILABLE, note=NOTE_TOOL_CONFIG)
        job = self._job(route, api, size + api.line_overhead)
        self.delegated += 1
        return Placement(ItemState.DELEGATED, job.id)

    def save(self) -> list[ProviderJob]:
        """Insert the jobs opened (they go with the items, in the caller's transaction). A job with fewer
        records than its API takes is not opened: its records, stored by now, run in the relay instead."""
        small = [job for job in self.jobs if job.records < self.minimum.get(job.id, 1)]
        if small:
            ids = [job.id for job in small]
            n = delegated.not_sent(self.batch.id, ids, NOTE_MIN_RECORDS)
            self.delegated -= n
            self.jobs = [job for job in self.jobs if job.id not in set(ids)]
            transaction.on_commit(dispatch.wake_workers)
            log.info("batch %s: %d record(s) run in the relay: too few for a provider job", self.batch.id, n)
        if self.jobs:
            ProviderJob.objects.bulk_create(self.jobs)
        return self.jobs

    def _api(self, route) -> "type[wire.BatchAPI] | None":
        """The batch API of the route's binding: its host's kind names it (None: the kind has none)."""
        key = (route.host.id, route.adapter)
        if key not in self.apis:
            self.apis[key] = wire.for_host(route.host, route.adapter)
        return self.apis[key]

    def _route(self, model):
        if not isinstance(model, str) or not model:
            return None
        if model not in self.routes:
            try:
                self.routes[model] = routing.resolve(self.policy, model, self.snapshot)
            except RelayError:
                self.routes[model] = None  # it fails in the relay, as it would have
        return self.routes[model]

    def _job(self, route, api: type[wire.BatchAPI], size: int) -> ProviderJob:
        """The binding's open job, or a new one when the record would take it past the API's limits."""
        max_records, max_bytes = api.limits(route.host)
        if settings.RELAY_PROVIDER_JOB_MAX_RECORDS:
            max_records = min(max_records, settings.RELAY_PROVIDER_JOB_MAX_RECORDS)
        job = self.open.get(route.binding.id)
        if job is None or job.records + 1 > max_records or job.bytes + size > max_bytes:
            job = ProviderJob(
                id=uuid6.uuid7(),
                batch_id=self.batch.id,
                binding_id=route.binding.id,
                host_id=route.host.id,
                kind=api.kind,
                endpoint=self.endpoint,
                status=JobStatus.PENDING,
            )
            self.open[route.binding.id] = job
            self.jobs.append(job)
            self.minimum[job.id] = api.min_records
        job.records += 1
        job.bytes += size
        return job


def _has_tool_config(body: dict) -> bool:
    try:
        return tools_config.extract(body)[1] is not None
    except tools_config.ToolError:
        return True  # refused at validation; never sent anywhere
