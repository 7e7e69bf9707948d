"""The project shell (settings, URLs, the Celery app, processes, operator pages) over core (bottom layer)
and gateway (the live path). Importing this package loads nothing: core must stay importable alone."""
