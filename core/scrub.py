"""No secret leaves the relay, in any encoding (docs/decisions/0004-redaction.md).

A provider may echo the credential it was sent (a 401 body such as
`Incorrect API key provided: sk-live-…`), and it may echo it escaped: one character written
as `\\u002d` passes a plain substring match and is decoded again by whoever parses the JSON (the
relay when it re-serializes a result, the tenant's client on a live call). So every byte string
that came from a provider passes through here before it reaches a caller, a result or error
file, an item's kept error body, or a log line, and each secret in it is replaced by REDACTED
in every form we know of:

- plain;
- JSON-escaped (any character as `\\uXXXX`, `/` as `\\/`), percent-encoded (`%2D`) and as HTML
  character references (`&#x2d;`, `&#45;`), mixed, and nested in one another: the text is decoded
  layer by layer as a reader would (`\\\\u002d`, a JSON string inside a JSON string, is `\\u002d`
  after one layer and `-` after two; `%252D` is `%2D`, then `-`), up to four layers;
- base64 and base64url: a run of base64 letters is redacted whole when it holds a secret's own
  base64 letters (at any of the three byte alignments), or when, decoded, it holds a secret in any
  of these forms (nested too, to a depth of 3); it is also decoded from after a `/`, `_` or `-` near
  its front (a path glued to it), and runs wrapped over lines are joined first;
- and a JSON body is checked once more on its decoded form: each string value is decoded,
  redacted, and the body re-encoded when one of them held a secret the raw text did not show.

Secrets: every host-key value the pipeline decrypted to call a provider (`remember()`: all pool
keys of the route, so the key actually sent is always covered, even one rotated a second ago);
with `load=True` (the default) every HostKey value in the catalog, reloaded at most every
RELOAD_SECONDS; the master key, admin token and Django secret key of the settings; and anything
shaped like a relay key (`sk-wr-` and 32+ key letters), whose secrets the relay never stores.
The pipeline and log lines use `load=False`: no database query on the hot path or in logging.

The matcher (the secrets, longest first, and one compiled pattern of their base64 letters) is built
when the secrets change, not per call: a version number moves when a new value is remembered, when the
catalog's values reloaded differ, when a catalog write bumps the generation (core.generation calls
`catalog_changed`: the host keys are read again at the next `load=True` use) or when a setting changes
(tests); every other call reuses it. A text shorter than MIN_LENGTH cannot hold a secret in any form
(each form is at least as long as the secret) and is returned at once.
"""

import base64
import binascii
import logging
import os
import re
import threading
import time

import orjson

log = logging.getLogger(__name__)

REDACTED = "[host key redacted]"
# Shorter values are not scrubbed: replacing a 3-character "key" everywhere would mangle bodies.
MIN_LENGTH = 8
RELOAD_SECONDS = 60.0
_MAX_REMEMBERED = 10_000
# Runs whose decoding a matcher remembers (`_holds_secret`), at most: a stream repeats its ids in every event.
_MAX_DECODED = 4096
# How deep base64 inside base64 is opened, and how many layers of escapes are decoded.
_MAX_DEPTH = 3
_MAX_LAYERS = 4
# A run this long may hold a secret of MIN_LENGTH bytes in base64 (8 bytes → 12 letters).
_B64_MIN = 12
_B64_RUN = re.compile(r"[A-Za-z0-9+/_-]{12,}={0,2}")
# Base64 wrapped over lines: runs of letters joined by real line breaks or JSON's escaped ones.
_LINE_BREAK = re.compile(r"\r?\n|\\r\\n|\\n")
# (A first line of 16 letters or more, starting where a run starts: MIME and PEM lines are 64-76 long,
# and the regex engine then skips ordinary words at once.)
_B64_WRAPPED = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{16,}(?:(?:\r?\n|\\r\\n|\\n)[A-Za-z0-9+/_-]{4,})+={0,2}")
# Relay key secrets are never stored, so they are found by their shape (core.crypto.new_relay_key).
_RELAY_KEY_PREFIX = "sk-wr-"
_RELAY_KEY_LETTERS = 32

_lock = threading.Lock()
_remembered: set[str] = set()
_catalog: frozenset[str] = frozenset()
_loaded_at = float("-inf")
# Moves whenever the set of secrets may have changed; the matcher is rebuilt only then (`_matcher`).
_version = 0
_compiled: tuple[int, "_Matcher"] | None = None
# The settings' secrets, read once (a setting changed in a test drops them: `_settings_changed`).
_static: frozenset[str] | None = None


def remember(value: str) -> None:
    """Record a host-key value the relay is about to send to a provider."""
    global _version
    if not value or len(value) < MIN_LENGTH or value in _remembered:
        return
    with _lock:
        if len(_remembered) >= _MAX_REMEMBERED:
            _remembered.clear()
        _remembered.add(value)
        _version += 1


def catalog_changed() -> None:
    """A catalog write (core.generation's bump): the host keys are read again at the next `load=True`
    use, so a key added or rotated a moment ago is scrubbed from then on, not after RELOAD_SECONDS."""
    global _loaded_at
    _loaded_at = float("-inf")


def _reload_catalog() -> None:
    global _catalog, _loaded_at, _version
    if time.monotonic() - _loaded_at < RELOAD_SECONDS:
        return
    _loaded_at = time.monotonic()
    from core.crypto import SecretUnavailable
    from core.models import HostKey

    values = set()
    try:
        for key in HostKey.objects.all():
            try:
                values.add(key.get_value())
            except (SecretUnavailable, ValueError):
                continue
    except Exception:  # no database (a management command, a test without db): keep what is known
        log.debug("could not load host keys for scrubbing", exc_info=True)
        return
    # Every variable under the host-key prefix is a provider secret the operator declared, whether a host key
    # reads it (value_env) or a host kind does (a Bedrock host's session token): scrubbed alike.
    from django.conf import settings

    prefix = getattr(settings, "RELAY_HOSTKEY_ENV_PREFIX", "")
    if prefix:
        values.update(v for name, v in os.environ.items() if name.startswith(prefix))
    loaded = frozenset(v for v in values if len(v) >= MIN_LENGTH)
    if loaded != _catalog:
        with _lock:
            _catalog = loaded
            _version += 1


_SETTINGS_NAMES = ("RELAY_MASTER_KEY", "RELAY_ADMIN_TOKEN", "SECRET_KEY")


def _settings_secrets() -> frozenset[str]:
    global _static
    if _static is not None:
        return _static
    try:
        from django.conf import settings
        from django.test.signals import setting_changed

        values = (getattr(settings, n, "") for n in _SETTINGS_NAMES)
        static = frozenset(v for v in values if isinstance(v, str) and len(v) >= MIN_LENGTH)
        setting_changed.connect(_settings_changed, dispatch_uid="core.scrub")
    except Exception:  # settings not configured (a bare import): no static secrets to add (and none kept)
        return frozenset()
    _static = static
    return static


def _settings_changed(setting=None, **kwargs) -> None:
    global _static, _version
    if setting in _SETTINGS_NAMES:
        with _lock:
            _static = None
            _version += 1


def known_values(*, load: bool = True) -> list[str]:
    """Longest first, so a key that contains another is replaced whole."""
    if load:
        _reload_catalog()
    with _lock:
        values = set(_remembered) | _catalog
    values |= _settings_secrets()
    return sorted(values, key=len, reverse=True)


def forget_all() -> None:
    """Tests: start from an empty state (and reload the catalog on next use)."""
    global _catalog, _loaded_at, _compiled, _version, _static
    with _lock:
        _remembered.clear()
        _catalog = frozenset()
        _loaded_at = float("-inf")
        _compiled = None
        _static = None
        _version += 1


# --- the matcher: every secret found in a decoded view of the text ------------------------------

# An encoded character: a percent escape, a JSON escape, or an HTML character reference. Each layer
# decodes one level, as a reader would (`\\u002d`, a JSON string inside a JSON string, is `\u002d`
# after one layer and `-` after two; `%252D` is `%2D`, then `-`).
_ESCAPE = re.compile(
    r"%([0-9a-fA-F]{2})"
    r"|\\u([0-9a-fA-F]{4})"
    r"|\\([\\/\"bfnrt])"
    # HTML references as browsers read them: any zero padding, the `;` optional — but not when the
    # reference runs on into an escape (`&#4\u0038;` is `&#48;` one layer down, not `&#4`).
    r"|&#[xX]0*([0-9a-fA-F]{1,6})(?:;|(?![0-9a-fA-F\\%&]))"
    r"|&#0*([0-9]{1,7})(?:;|(?![0-9\\%&]))"
)
_JSON_SHORT = {"\\": "\\", "/": "/", '"': '"', "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# Only an escape of an ASCII character can be part of a secret (they are ASCII), and an escaped
# backslash may start a nested escape: a body whose escapes are all of other characters (`\u00e9`,
# `\n`) is not decoded at all. Each branch starts with a literal, so the regex engine skips ahead
# to the next `%`, `\` or `&`.
_ASCII_ESCAPE = re.compile(r"%[0-7][0-9a-fA-F]|\\(?:u00[0-7][0-9a-fA-F]|[\\/])|&#")


def _maybe_encoded(text: str) -> bool:
    # Substring tests first: a tenth of the regular expression's cost on a body with no escape.
    if "%" in text or "&#" in text or "\\u00" in text or "\\/" in text or "\\\\" in text:
        return _ASCII_ESCAPE.search(text) is not None
    return False


_RELAY_KEY = re.compile(re.escape(_RELAY_KEY_PREFIX) + f"[A-Za-z0-9_-]{{{_RELAY_KEY_LETTERS},}}")


def _b64_cores(value: str) -> set[str]:
    """The base64 letters that a secret always becomes inside a longer base64 text, at each of the
    three byte alignments it can start at, in both alphabets (the edge letters that mix in the
    neighbours' bits are left out)."""
    raw = value.encode()
    cores = set()
    for pad in range(3):
        letters = base64.b64encode(b"\0" * pad + raw).decode().rstrip("=")
        start = (pad * 8 + 5) // 6
        end = ((pad + len(raw)) * 8) // 6
        core = letters[start:end]
        if len(core) >= MIN_LENGTH:
            cores.add(core)
            cores.add(core.replace("+", "-").replace("/", "_"))
    return cores


class _Matcher:
    def __init__(self, values: tuple[str, ...]):
        self.values = values
        cores = sorted({core for v in values for core in _b64_cores(v)}, key=len, reverse=True)
        # One pattern for every secret's base64 letters: a run is scanned once, not once per secret.
        self.b64 = re.compile("|".join(map(re.escape, cores))) if cores else None
        # Runs decoded with these secrets: whether each held one (`_holds_secret`).
        self.decoded: dict[tuple[str, int], bool] = {}


def _matcher(load: bool) -> _Matcher:
    """The matcher of the secrets known now: built again only when they may have changed (`_version`)."""
    global _compiled
    if load:
        _reload_catalog()
    cached = _compiled
    if cached is not None and cached[0] == _version:
        return cached[1]
    # The version is read before the values: a value remembered meanwhile moves it again, so the next
    # call rebuilds rather than keep a matcher that misses it.
    version = _version
    matcher = _Matcher(tuple(known_values(load=False)))
    _compiled = (version, matcher)
    return matcher


# --- redaction -----------------------------------------------------------------------------------


def _decode_token(token: re.Match) -> str:
    hex2, hex4, short, hexref, decref = token.groups()
    if short is not None:
        return _JSON_SHORT[short]
    code = int(hex2 or hex4 or hexref, 16) if decref is None else int(decref)
    return chr(code) if code <= 0x10FFFF else "\ufffd"


def _starts(text: str) -> list[int]:
    """For each character of `_ESCAPE.sub(_decode_token, text)`, the offset in `text` where it
    starts; one more entry: the end. Built only when a secret was found in the decoded text."""
    starts: list[int] = []
    at = 0
    for token in _ESCAPE.finditer(text):
        starts.extend(range(at, token.start()))
        starts.append(token.start())
        at = token.end()
    starts.extend(range(at, len(text) + 1))
    return starts


def _occurrences(haystack: str, needle: str) -> list[tuple[int, int]]:
    spans = []
    at = haystack.find(needle)
    while at != -1:
        spans.append((at, at + len(needle)))
        at = haystack.find(needle, at + len(needle))
    return spans


def _spans(haystack: str, m: _Matcher) -> list[tuple[int, int]]:
    spans = [span for value in m.values for span in _occurrences(haystack, value)]
    if _RELAY_KEY_PREFIX in haystack:
        spans.extend(match.span() for match in _RELAY_KEY.finditer(haystack))
    return spans


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each span (merged where they overlap) replaced by REDACTED."""
    out, at = [], 0
    for start, end in sorted(spans):
        if end <= at:
            continue
        start = max(start, at)
        out.append(text[at:start])
        out.append(REDACTED)
        at = end
    out.append(text[at:])
    return "".join(out)


def _find(text: str, m: _Matcher, depth: int) -> list[tuple[int, int]]:
    """Where secrets are in `text`, in any form: found in the text and in each decoded layer of it
    (escapes decoded, then decoded again while something changes), mapped back to `text`."""
    layers = [text]
    if _maybe_encoded(text):
        for _ in range(_MAX_LAYERS):
            decoded = _ESCAPE.sub(_decode_token, layers[-1])
            if decoded == layers[-1]:
                break
            layers.append(decoded)
    found = []
    for level in range(len(layers) - 1, -1, -1):
        spans = _spans(layers[level], m) + _b64_spans(layers[level], m, depth)
        for outer in range(level - 1, -1, -1):
            if not spans:
                break
            starts = _starts(layers[outer])
            spans = [(starts[a], starts[b]) for a, b in spans]
        found += spans
    return found


def _b64_spans(text: str, m: _Matcher, depth: int) -> list[tuple[int, int]]:
    """Runs of base64 letters that hold a secret, redacted whole: its own letters at any alignment,
    or, decoded, a secret in any form (base64 inside base64 to a depth of _MAX_DEPTH). A run is also
    decoded from after each `/`, `_` or `-` in it (a path or a name glued to its front shifts its
    alignment), and runs wrapped over lines (MIME, PEM, `\\n` in JSON) are joined first."""
    spans = []
    wrapped = False
    for run in _B64_RUN.finditer(text):
        if _holds_secret(run.group(0), m, depth):
            spans.append(run.span())
        # A wrapped run starts with a run of 16 letters or more ended by a line break (`\r`, `\n`, or a
        # JSON escape's backslash): without one, its scan (as long as this one) cannot match and is skipped
        # (with the decode cache below, a streamed chat chunk's scrub went from 11.5 to 7.9 us of CPU).
        end = run.end()
        if not wrapped and end - run.start() >= 16 and text[end : end + 1] in _BREAK_STARTS:
            wrapped = True
    if wrapped:
        for run in _B64_WRAPPED.finditer(text):
            if _holds_secret(_LINE_BREAK.sub("", run.group(0)), m, depth):
                spans.append(run.span())
    return spans


_BREAK_STARTS = frozenset({"\r", "\n", "\\"})


def _holds_secret(letters: str, m: _Matcher, depth: int) -> bool:
    if m.b64 is not None and m.b64.search(letters):
        return True
    if depth >= _MAX_DEPTH or not _may_be_base64(letters):
        return False
    # The same run comes back in every event of a stream (a completion's id): decoded once per matcher
    # (a chunk with OpenAI's 29-letter id: 24.5 us of CPU to scrub before, 10 us now).
    known = m.decoded.get((letters, depth))
    if known is not None:
        return known
    held = _decodes_to_secret(letters, m, depth)
    if len(m.decoded) >= _MAX_DECODED:
        m.decoded.clear()
    m.decoded[(letters, depth)] = held
    return held


def _decodes_to_secret(letters: str, m: _Matcher, depth: int) -> bool:
    # A prefix glued to the front is short (a path, a name): separators past the first 64 letters are
    # the base64url alphabet's own, and decoding from each would cost a pass per letter.
    starts = [0] + [i + 1 for i, c in enumerate(letters[:64]) if c in "/_-" and len(letters) - i > _B64_MIN]
    for start in starts:
        decoded = _b64_decode(letters[start:])
        if decoded is not None and _find(decoded, m, depth + 1):
            return True
    return False


def _may_be_base64(letters: str) -> bool:
    """Base64 of a dozen or more bytes of text has upper- and lower-case letters; an identifier such
    as `completion_tokens` or a lower-case hex id does not, and is not decoded."""
    return letters != letters.lower() and letters != letters.upper()  # C-speed: an upper and a lower case


def _redact(text: str, m: _Matcher, depth: int = 0) -> str:
    spans = _find(text, m, depth)
    return _cut(text, spans) if spans else text


def _b64_decode(run: str) -> str | None:
    body = run.rstrip("=").replace("-", "+").replace("_", "/")
    if len(body) % 4 == 1:
        return None
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    # Binary (an image, a compressed blob) is searched as Latin-1, so a secret inside still matches.
    return raw.decode("utf-8", "replace") if raw.isascii() else raw.decode("latin-1")


def _decoded_strings_clean(value, m: _Matcher) -> tuple[object, bool]:
    """A parsed JSON value with each string redacted on its decoded form; and whether any changed."""
    if isinstance(value, str):
        clean = _redact(value, m, 0)
        return clean, clean != value
    if isinstance(value, list):
        changed = False
        out = []
        for item in value:
            clean, hit = _decoded_strings_clean(item, m)
            out.append(clean)
            changed |= hit
        return out, changed
    if isinstance(value, dict):
        changed = False
        out = {}
        for key, item in value.items():
            clean_key, hit_key = _decoded_strings_clean(key, m)
            clean, hit = _decoded_strings_clean(item, m)
            out[clean_key] = clean
            changed |= hit or hit_key
        return out, changed
    return value, False


def scrub_text(text: str, *, load: bool = True) -> str:
    if not text or len(text) < MIN_LENGTH:  # too short to hold any secret, in any form
        return text
    return _redact(text, _matcher(load), 0)


def scrub_bytes(data: bytes, *, load: bool = True) -> bytes:
    if not data or len(data) < MIN_LENGTH:
        return data
    m = _matcher(load)
    text = data.decode("utf-8", "surrogateescape")
    clean = _redact(text, m, 0)
    if clean.lstrip()[:1] in ("{", "[") and _maybe_encoded(clean):
        # The decoded form: a JSON escape this text did not show as one (none is known) still
        # cannot carry a secret through, since each string is checked once more after decoding.
        try:
            parsed = orjson.loads(clean.encode("utf-8", "surrogateescape"))
        except orjson.JSONDecodeError:
            parsed = None
        if parsed is not None:
            redacted, changed = _decoded_strings_clean(parsed, m)
            if changed:
                return orjson.dumps(redacted)
    if clean == text:
        return data
    return clean.encode("utf-8", "surrogateescape")


def scrub_headers(headers: dict, *, load: bool = True) -> dict:
    return {name: scrub_text(value, load=load) if isinstance(value, str) else value for name, value in headers.items()}


class ScrubFilter(logging.Filter):
    """A logging filter (settings.LOGGING) that removes known secrets from every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            clean = scrub_text(message, load=False)
            if clean != message:
                record.msg, record.args = clean, ()
            if record.exc_text:
                record.exc_text = scrub_text(record.exc_text, load=False)
        except Exception:  # a filter must never lose the record
            pass
        return True


def install_filter(*loggers: logging.Logger | None) -> None:
    """Put a ScrubFilter on every handler of the root logger and of `loggers` that has none: handlers set up
    outside settings.LOGGING (Celery's, in worker and beat processes) scrub their records too."""
    for logger in (logging.getLogger(), *loggers):
        for handler in getattr(logger, "handlers", ()):
            if not any(isinstance(f, ScrubFilter) for f in handler.filters):
                handler.addFilter(ScrubFilter())
