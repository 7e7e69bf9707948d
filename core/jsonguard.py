"""One input discipline for every JSON value a client sends (decision 0009).

A body, a JSONL line or a native batch item is refused here, with the JSON path
of the offending field, when it holds:

- a NUL character (PostgreSQL text cannot store it) or a lone surrogate (it
  cannot be encoded as UTF-8), in any key or string;
- nesting deeper than MAX_DEPTH arrays/objects (a 10,000-deep document would
  otherwise exhaust the interpreter's recursion limit when parsed or re-encoded);
- a non-finite number: `NaN`, `Infinity`, `-Infinity` or an overflowing literal
  such as `1e400` (not JSON per RFC 8259; forwarded, they become non-standard JSON);
- more than MAX_VALUES values (arrays, objects, keys and scalars together): a
  32 MiB body of empty arrays would take a web worker 800 MB and seconds of CPU
  to build, and a worker keeps much of what it once allocated (decision 0014).

Duplicate keys are accepted and the last one wins, everywhere the relay reads
JSON: live bodies, batch bodies (a second `requests` array replaces the first:
batches.ingest), JSONL records. The relay re-encodes the body it parsed, so the
provider sees the same value the relay checked.

A syntax error says where, in one sentence: "JSON syntax error at line L, column C: …".

`loads()` parses and checks; `check()` checks a value that is already parsed
(ijson's streaming parse of a batch body); `encode()` checks a parsed value and
returns it as compact JSON, the cheap way for the usual value (see there). Both raise JSONGuardError, a
ValueError, so callers that already treat "not JSON" as bad input need no change.
"""

import json
import math
import re
import sys

import orjson

# Arrays/objects nested deeper than this are refused. Real requests (messages,
# tool JSON schemas) stay far below it; it keeps parse and re-encode well within
# Python's recursion limit.
MAX_DEPTH = 64
# At most this many values in one document (or one batch element): at most ~100 MB of Python objects
# even when each is an empty array, while real requests (messages, tool schemas, an embedding's token
# ids) stay far below it.
MAX_VALUES = 1_000_000
# How much of a client's key a path in an error message quotes (core.errors.CLIENT_VALUE_CHARS).
_KEY_CHARS = 100


class JSONGuardError(ValueError):
    """`code`: invalid_json | invalid_characters | nesting_too_deep | non_finite_number | too_many_values;
    `path`: the field."""

    def __init__(self, code: str, message: str, path: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if len(key) > _KEY_CHARS:  # a 1 MiB key name must not make a 1 MiB error
        key = key[:_KEY_CHARS] + "…"
    return f"{path}.{key}" if path else str(key)


def _bad_char(text: str) -> str | None:
    """What is wrong with a string, or None."""
    if "\x00" in text:
        return "a NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (an unpaired \\ud800-\\udfff escape)"
    return None


def _printable(path: str) -> str:
    """A path fit for an error message: the offending characters themselves escaped."""
    return path.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace").replace("\x00", "\\u0000")


def check(value, path: str = "", *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse NUL/lone surrogates, non-finite numbers and excessive depth anywhere in `value`."""
    # Iterative, so the check itself never recurses however deep the value is.
    stack = [(value, path, 0)]
    seen = 0
    while stack:
        node, where, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise _too_many_values(_printable(path) or "body")
        if isinstance(node, str):
            problem = _bad_char(node)
            if problem:
                shown = _printable(where) or "body"
                raise JSONGuardError("invalid_characters", f"{shown} contains {problem}", where)
        elif isinstance(node, float):
            if not math.isfinite(node):
                shown = _printable(where) or "body"
                raise JSONGuardError(
                    "non_finite_number", f"{shown} is not a finite number (NaN, Infinity and 1e400 are refused)", where
                )
        elif isinstance(node, dict | list):
            if depth >= max_depth:
                shown = _printable(where) or "body"
                raise JSONGuardError(
                    "nesting_too_deep", f"{shown} is nested deeper than {max_depth} levels of arrays/objects", where
                )
            if isinstance(node, dict):
                for key, child in node.items():
                    child_path = _join(where, key)
                    if isinstance(key, str):
                        problem = _bad_char(key)
                        if problem:
                            shown = _printable(where) or "body"
                            raise JSONGuardError("invalid_characters", f"a key of {shown} contains {problem}", where)
                    stack.append((child, child_path, depth + 1))
            else:
                for i, child in enumerate(node):
                    stack.append((child, _join(where, i), depth + 1))


# One encoder for encode()'s careful path: json.dumps with these options would build a new one per call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode(value, path: str = "", *, max_depth: int = MAX_DEPTH) -> bytes:
    """`value` (parsed JSON: dicts, lists, str, int, float, bool, None) as compact UTF-8 JSON, with
    check()'s guarantees; JSONGuardError as check() raises it.

    The usual value is checked by its own encoding rather than by walking it in Python. orjson
    encodes it first (the bench's 50,000 submitted elements: 0.27 s with the json module's encoder,
    0.02-0.11 s with orjson): it refuses a lone surrogate and an integer past 64 bits, a NUL can only
    appear escaped as `\u0000`, and a value with at most `max_depth` brackets in its text cannot
    nest deeper. orjson writes a non-finite float as `null`, so any output holding the bytes `null`
    (a real null, or merely the word in a string) goes the careful way: json.dumps(allow_nan=False)
    refuses non-finite numbers and encoding its text as UTF-8 refuses lone surrogates. Whatever
    trips either way (or merely might, like a string holding the six characters `\u0000`, or many
    brackets) goes through check(), which raises the exact error, naming the field.
    """
    try:
        data = orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError: a lone surrogate, a big integer, deep nesting
        data = None
    if data is None or b"null" in data:
        try:
            data = _COMPACT.encode(value).encode()
        except (ValueError, UnicodeEncodeError, RecursionError):
            check(value, path, max_depth=max_depth)
            raise  # not reached: check() refuses whatever made the encoding fail
    if b"\\u0000" in data or data.count(b"{") + data.count(b"[") > max_depth:
        check(value, path, max_depth=max_depth)
    return data


def _too_many_values(shown: str) -> JSONGuardError:
    return JSONGuardError(
        "too_many_values", f"{shown} holds more than {MAX_VALUES} JSON values (arrays, objects, keys and scalars)"
    )


# JSON strings, so the punctuation inside them is not counted as structure (_count_ok).
_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _count_ok(text: str, max_values: int) -> bool:
    """Whether `text` holds at most `max_values` values, counted before anything is built. Every value or
    key is the first in its array or object, follows a comma or a colon, or is the document itself,
    so counting those characters bounds it from above; only when that bound is over the limit are
    the strings taken out (their commas are text) and the count made again."""

    def bound(t: str) -> int:
        return t.count(",") + t.count(":") + t.count("[") + t.count("{") + 1

    return bound(text) <= max_values or bound(_STRINGS.sub('""', text)) <= max_values


def _syntax_message(exc: ValueError) -> str:
    """json's error as one sentence: where (line, column), then what."""
    if isinstance(exc, json.JSONDecodeError):
        what = exc.msg[:1].lower() + exc.msg[1:]
        return f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {what}"
    if "integer string conversion" in str(exc):  # an integer literal past Python's digit limit
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return "not JSON"


def _refuse_constant(name: str):
    raise JSONGuardError("non_finite_number", f"{name} is not a JSON number (non-finite numbers are refused)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONGuardError("non_finite_number", f"the number {text[:40]} overflows (non-finite numbers are refused)")
    return value


def _depth_ok(text: str, max_depth: int) -> bool:
    """Cheap pre-scan: brackets outside strings never nest deeper than max_depth."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH):
    """Parse JSON text and check it. JSONGuardError (code invalid_json for plain syntax errors)."""
    if isinstance(raw, bytes | bytearray):
        try:
            text = bytes(raw).decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise JSONGuardError("invalid_json", f"not valid UTF-8: {exc.reason} at byte {exc.start}") from exc
    else:
        text = raw.removeprefix("\ufeff")
    if not _count_ok(text, MAX_VALUES):
        raise _too_many_values("body")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except JSONGuardError:
        raise
    except RecursionError:
        raise JSONGuardError(
            "nesting_too_deep", f"body is nested deeper than {max_depth} levels of arrays/objects"
        ) from None
    except ValueError as exc:  # JSONDecodeError, and int literals past Python's digit limit
        # A very deep document may still fail on syntax; say "too deep" when it is.
        if len(text) > 2 * max_depth and not _depth_ok(text, max_depth):
            raise JSONGuardError(
                "nesting_too_deep", f"body is nested deeper than {max_depth} levels of arrays/objects"
            ) from None
        raise JSONGuardError("invalid_json", _syntax_message(exc)) from exc
    check(value, max_depth=max_depth)
    return value
