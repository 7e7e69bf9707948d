"""The Celery app `relay`. Configuration lives in Django settings (CELERY_*); the batch workers'
warm-up receivers are connected by the batches app (batches/apps.py), so this module imports
nothing of the batch engine."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")
# Celery's Django fixup runs Django's system checks in every worker and beat at start (URLs, admin, models:
# 0.1-0.3 CPU-s each, once per process and pool). They are the deployment's checks, not the process's:
# `migrate`, compose's first step (and embedded mode's), runs them with the same settings before any worker
# starts. An operator who wants them per process sets CELERY_SKIP_CHECKS= (empty).
os.environ.setdefault("CELERY_SKIP_CHECKS", "1")

app = Celery("relay")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Celery sets up its own handlers in every worker and beat process (the root logger's, unless
# CELERY_WORKER_HIJACK_ROOT_LOGGER is off, and always the task logger's, which does not propagate): the
# secret-scrubbing filter of settings.LOGGING is put on each of them once they exist.
@signals.after_setup_logger.connect(weak=False)
@signals.after_setup_task_logger.connect(weak=False)
def _scrub_celery_handlers(logger=None, **kwargs):
    from core.scrub import install_filter

    install_filter(logger)
