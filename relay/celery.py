"""The Celery app `relay`. Configuration lives in Django settings (CELERY_*); the batch workers'
warm-up receivers are connected by the batches app (batches/apps.py), so this module imports
nothing of the batch engine."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")

app = Celery("relay")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
