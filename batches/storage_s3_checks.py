"""The s3 payload store's system checks (`manage.py check`; `migrate`, compose's first step, runs them at
every deployment's start): settings that cannot work, and a bucket that does not answer."""

import logging

from django.conf import settings
from django.core import checks

from batches import storage_s3
from batches.storage_errors import PayloadStoreUnavailable

log = logging.getLogger(__name__)


def ping() -> None:
    """Raises PayloadStoreUnavailable unless the bucket answers (short timeouts, no retries)."""
    cfg = storage_s3.config()
    if not cfg.bucket:
        raise PayloadStoreUnavailable("RELAY_BATCH_PAYLOAD_STORE=s3 but RELAY_S3_BUCKET is not set")
    client = storage_s3.make_client(cfg, probe=True)
    with storage_s3.errors(cfg, "reach bucket", cfg.bucket):
        client.head_bucket(Bucket=cfg.bucket)


# --- system checks (`manage.py check`; `migrate` runs them at every deployment's start) -------------


@checks.register("payload_store")
def check_settings(app_configs=None, **kwargs) -> list:
    """What can be told without the network."""
    if getattr(settings, "RELAY_BATCH_PAYLOAD_STORE", "dir") != "s3":
        return []
    errors = []
    cfg = storage_s3.config()
    if not cfg.bucket:
        errors.append(
            checks.Error(
                "RELAY_BATCH_PAYLOAD_STORE=s3 needs RELAY_S3_BUCKET.",
                hint="Set RELAY_S3_BUCKET (and RELAY_S3_ENDPOINT_URL for a store other than AWS S3).",
                id="batches.E301",
            )
        )
    if (cfg.access_key is None) != (cfg.secret_key is None):
        errors.append(
            checks.Error(
                "Only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY is set.",
                hint="Set both, or neither to use boto3's own credential chain (instance role, ~/.aws).",
                id="batches.E302",
            )
        )
    try:
        import boto3  # noqa: F401
    except ImportError:
        errors.append(checks.Error("RELAY_BATCH_PAYLOAD_STORE=s3 needs boto3 (requirements.txt).", id="batches.E303"))
    return errors


@checks.register(checks.Tags.database)
def check_reachable(app_configs=None, databases=None, **kwargs) -> list:
    """Whether the bucket answers. Tagged `database`, as Django's checks that need the network are: run
    by `migrate` (compose's first step) and `manage.py check --database default`, not by every command."""
    if not databases or getattr(settings, "RELAY_BATCH_PAYLOAD_STORE", "dir") != "s3" or check_settings():
        return []
    cfg = storage_s3.config()
    try:
        ping()
    except PayloadStoreUnavailable as exc:
        return [
            checks.Error(
                f"The S3 payload store does not answer: {exc.reason}",
                hint=(
                    f"Bucket {cfg.bucket!r} at {cfg.endpoint_url or 'AWS S3'} (region {cfg.region}): check "
                    "RELAY_S3_ENDPOINT_URL, RELAY_S3_BUCKET (it must exist) and the AWS_ACCESS_KEY_ID / SECRET pair."
                ),
                id="batches.E304",
            )
        ]
    return []
