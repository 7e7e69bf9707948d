"""Tool calling inside batch records: `body.openrelay.tool_config` with HTTP and MCP executors (decision 0013).

- `config`: parse and validate `tool_config`, strip the relay-owned `openrelay` key.
- `netguard`: the SSRF guard every executor connection goes through.
- `executors`: run one round of tool calls on an `http` or `mcp` executor.
- `loop`: `run_tool_loop`, the model ↔ executor loop of one record.

See docs/tool-calling.md for the contract, limits, security and failure codes.

`run_tool_loop` and `LoopResult` are imported on first use: the loop needs the
pipeline (and so the ORM), while code that only validates a record body at
submit time should be able to import `batches.tools` without loading it.
"""

from batches.tools.config import ToolConfig, ToolError, extract, parse_tool_config, strip_openrelay

__all__ = [
    "LoopResult",
    "ToolConfig",
    "ToolError",
    "extract",
    "parse_tool_config",
    "run_tool_loop",
    "strip_openrelay",
]


def __getattr__(name: str):
    if name in ("run_tool_loop", "LoopResult"):
        from batches.tools import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
