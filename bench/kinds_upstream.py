"""The fake provider of `make bench-kinds` (bench/kinds.py): bench/fake_upstream.py's server, which already plays
every host kind's wire (devkit.upstream: OpenAI, Anthropic, Azure OpenAI, the Gemini API, an OpenAI-compatible
server, Bedrock with its S3 stand-in, Vertex AI with its token endpoint and Cloud Storage), with the fake Azure
resource's quota out of the way (below) and three additions:

- POST /_bench/kinds_config {"batch_seconds": 30}: how long a batch job takes at every kind's batch API (the
  OpenAI-style ones and Bedrock share devkit.batches' `job_seconds`; Vertex keeps its own);
- GET /_bench/kinds_log → {"log": [{"t", "api", "op", "job", "status"}]}: every batch-API request of every kind
  (devkit.batches' log, Bedrock's and Vertex's), without their headers, so polls can be counted per job;
- POST /_bench/vertex_token → {"token"}: an access token for the demo service account, so the benchmark's direct
  calls to the fake Vertex AI need no JWT of their own (the relay still mints its tokens at POST /token).

    python -m bench.kinds_upstream       (prints `READY http://127.0.0.1:<port>`, as bench/fake_upstream.py)
"""

import json
import secrets
import time

from bench.fake_upstream import BenchUpstream, _BenchHandler, serve
from devkit import clouds
from devkit.vertex import DEMO_CLIENT_EMAIL

# The fake Azure resource counts each key's quota down and never resets it (a test device: it only says what is
# left). Past its 1,000 requests the relay's token pacing would hold the records, so a 10,000-record batch would
# measure the fake's exhausted quota, not the relay: here the quota is as large as a real one's window is wide.
clouds.AZURE_REQUESTS = 10**9
clouds.AZURE_TOKENS = 10**12


class KindsUpstream(BenchUpstream):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.RequestHandlerClass = _KindsHandler


class _KindsHandler(_BenchHandler):
    server: KindsUpstream

    def do_GET(self):
        if self.path == "/_bench/kinds_log":
            return self._json(200, {"log": self._log()})
        return super().do_GET()

    def do_POST(self):
        srv = self.server
        if self.path == "/_bench/kinds_config":
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if "batch_seconds" in body:
                seconds = float(body["batch_seconds"])
                srv.batches.job_seconds = seconds  # OpenAI, Anthropic, Azure, OpenAI-compatible, Bedrock
                srv.vertex.job_seconds = seconds
            return self._json(200, {"batch_seconds": srv.batches.job_seconds})
        if self.path == "/_bench/vertex_token":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            token = "ya29.bench-" + secrets.token_hex(16)
            with srv.vertex.lock:
                srv.vertex.tokens[token] = (DEMO_CLIENT_EMAIL, time.time() + 3600)
            return self._json(200, {"token": token})
        return super().do_POST()

    def _log(self) -> list[dict]:
        srv = self.server
        out = []
        sources = (
            ("batches", srv.batches.lock, srv.batches.log),
            ("bedrock", srv.batches.bedrock.lock, srv.batches.bedrock.log),
            ("vertex", srv.vertex.lock, srv.vertex.log),
        )
        for name, lock, entries in sources:
            with lock:
                rows = list(entries)
            for e in rows:
                api = e.get("provider", name) if name == "batches" else name
                out.append({"t": e["t"], "api": api, "op": e.get("op"), "job": e.get("job"), "status": e["status"]})
        out.sort(key=lambda e: e["t"])
        return out


def main() -> None:
    serve(KindsUpstream())


if __name__ == "__main__":
    main()
