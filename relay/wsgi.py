import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")
application = get_wsgi_application()

from relay.webserver import warm_up  # noqa: E402 - needs the app (settings, apps) loaded

warm_up()
