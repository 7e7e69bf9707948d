#!/usr/bin/env bash
# Run one command against the embedded relay (`make run`): its generated secrets
# (.relay-embedded/secrets.env), its SQLite database, its Redis and payload dir.
#   bash scripts/embedded.sh manage.py relay key create …
#   bash scripts/embedded.sh celery -A relay flower --address=127.0.0.1 --port=5555
# Without it a manage command would run with placeholder secrets: host keys it
# encrypts could not be decrypted by the running relay.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh requirements.txt
exec .venv/bin/python -m relay.embedded exec "$@"
