"""One input discipline for every JSON value a client sends (issue 12).

A body, a JSONL line or a native batch item is refused here, with the JSON path
of the offending field, when it holds:

- a NUL character (PostgreSQL text cannot store it) or a lone surrogate (it
  cannot be encoded as UTF-8), in any key or string;
- nesting deeper than MAX_DEPTH arrays/objects (a 10,000-deep document would
  otherwise exhaust the interpreter's recursion limit when parsed or re-encoded);
- a non-finite number: `NaN`, `Infinity`, `-Infinity` or an overflowing literal
  such as `1e400` (not JSON per RFC 8259; forwarded, they become non-standard JSON).

Duplicate keys are accepted (the last one wins, as in every mainstream parser):
the relay re-encodes the body it parsed, so the provider sees the same value
the relay checked.

`loads()` parses and checks; `check()` checks a value that is already parsed
(ijson's streaming parse of a batch body); `encode()` checks a parsed value and
returns it as compact JSON, the cheap way for the usual value (see there). Both raise JSONGuardError, a
ValueError, so callers that already treat "not JSON" as bad input need no change.
"""

import json
import math

import orjson

# Arrays/objects nested deeper than this are refused. Real requests (messages,
# tool JSON schemas) stay far below it; it keeps parse and re-encode well within
# Python's recursion limit.
MAX_DEPTH = 64


class JSONGuardError(ValueError):
    """`code`: invalid_json | invalid_characters | nesting_too_deep | non_finite_number; `path`: the field."""

    def __init__(self, code: str, message: str, path: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
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
    while stack:
        node, where, depth = stack.pop()
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
        raise JSONGuardError("invalid_json", str(exc)) from exc
    check(value, max_depth=max_depth)
    return value
