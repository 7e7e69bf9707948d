"""What the batches' admin pages show of a payload, a JSON value, a batch's progress and its related rows:
the pieces the batches, items and files pages share (batches/admin.py, batches/admin_items.py)."""

import json

from django.urls import reverse
from django.utils.html import format_html, format_html_join

from batches import storage
from batches.models import File
from batches.surfaces.openai import read as openai_read

PREVIEW_BYTES = 4096


def preview(ref: str) -> str:
    if not ref:
        return ""
    try:
        data = storage.read(ref)
    except storage.PayloadMissing as exc:
        return f"(missing: {exc})"
    text = data[:PREVIEW_BYTES].decode("utf-8", errors="replace")
    if len(data) <= PREVIEW_BYTES:
        try:
            text = json.dumps(json.loads(data), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    else:
        text += f"\n… ({len(data)} bytes in all)"
    return format_html("<pre style='white-space:pre-wrap;max-width:80em'>{}</pre>", text)


def pretty(value) -> str:
    if value in (None, "", [], {}):
        return "—"
    return format_html(
        "<pre style='white-space:pre-wrap;max-width:80em'>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False)
    )


# completed, discarded, cancelled, running, available
_BAR_COLOURS = ("#2e7d32", "#c62828", "#9e9e9e", "#1565c0", "#e0e0e0")


def progress_bar(counts, label: str) -> str:
    """A bar of the items' states (widths in whole percent) above the counts, for the changelist."""
    total = sum(counts) or 1
    segments = format_html_join(
        "",
        '<span title="{}" style="display:inline-block;height:100%;width:{}%;background:{}"></span>',
        (
            (name, n * 100 // total if n else 0, colour)
            for name, n, colour in zip(
                ("completed", "discarded", "cancelled", "running", "available"), counts, _BAR_COLOURS, strict=True
            )
        ),
    )
    done = (counts[0] + counts[1] + counts[2]) * 100 // total
    return format_html(
        '<div class="relay-progress" style="width:12em;height:.7em;background:#f5f5f5;white-space:nowrap;'
        'overflow:hidden;border-radius:2px" title="{}% finished">{}</div><small>{}</small>',
        done,
        segments,
        label,
    )


def file_link(file_id) -> str:
    if file_id is None:
        return "—"
    label = f"file-{file_id.hex}"
    if not File.objects.filter(pk=file_id).exists():
        return f"{label} (deleted)"
    return format_html('<a href="{}">{}</a>', reverse("admin:batches_file_change", args=[file_id]), label)


def search_public_id(queryset, search_term, prefix):
    """Let the operator paste the id a client sees (batch_… / file-…)."""
    pk = openai_read.parse_public_id(search_term.strip(), prefix)
    return queryset.filter(pk=pk) if pk is not None else None


def related_links(batch_id) -> str:
    """A batch's rows in the other lists: its items, provider jobs, usage events and webhook deliveries."""
    lists = (
        ("items", "admin:batches_item_changelist", f"batch__id__exact={batch_id}"),
        ("provider jobs", "admin:batches_providerjob_changelist", f"batch__id__exact={batch_id}"),
        ("usage events", "admin:usage_usageevent_changelist", f"batch_id={batch_id}"),
        ("webhook deliveries", "admin:webhooks_delivery_changelist", f"event__batch_id={batch_id}"),
    )
    return format_html_join(" · ", '<a href="{}?{}">{}</a>', ((reverse(url), q, label) for label, url, q in lists))
