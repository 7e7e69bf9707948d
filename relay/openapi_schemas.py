"""The shared components of the OpenAPI schema (relay/openapi.py merges them in): every object the
API takes or answers, by name."""


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


STR, INT, BOOL, OBJ = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "object"}
TS = {"type": "integer", "description": "Unix seconds"}


def openai_list(item: str) -> dict:
    """An OpenAI list object (`{"object": "list", "data", "first_id", "last_id", "has_more"}`) of `item`s."""
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref(item)},
            "first_id": nullable(STR),
            "last_id": nullable(STR),
            "has_more": BOOL,
        },
    }


# Re-run what failed (docs/api/native.md, openai.md, anthropic.md): on every batch object of every
# surface, ids in the surface's form.
LINEAGE = {
    "retry_of": nullable({"type": "string", "description": "the batch whose failed records this one re-runs"}),
    "retried_by": {
        "type": "array",
        "items": STR,
        "description": "the batches made by retry_failed from this one, oldest first",
    },
}

SCHEMAS = {
    # --- errors ---
    "RelayError": {
        "type": "object",
        "description": "The relay's error envelope (inference, native batches, usage).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": STR, "message": STR, "code": STR},
            }
        },
    },
    "OpenAIError": {
        "type": "object",
        "description": "OpenAI's error envelope (files and OpenAI-surface batches).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {"message": STR, "type": STR, "param": nullable(STR), "code": nullable(STR)},
            }
        },
    },
    # --- inference (pass-through of the provider's wire format; the relay checks only what it routes on) ---
    "InferenceRequest": {
        "type": "object",
        "required": ["model"],
        "description": "The provider's request body (OpenAI or Anthropic wire format); `model` picks the route. "
        '`"stream": true` is refused.',
        "properties": {"model": STR, "stream": {"type": "boolean", "enum": [False]}},
        "additionalProperties": True,
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "choices"],
        "properties": {
            "id": STR,
            "object": {"const": "chat.completion"},
            "model": STR,
            "choices": {"type": "array", "items": OBJ},
            "usage": OBJ,
        },
    },
    "InferenceResponse": {
        "type": "object",
        "description": "The upstream's answer, passed through (chat.completion, text_completion, list of "
        "embeddings, response, or Anthropic message).",
        "additionalProperties": True,
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "owned_by"],
                    "properties": {"id": STR, "object": {"const": "model"}, "owned_by": STR},
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "description": "`database` and `redis` (which check failed, and why) only with the admin token",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "database": ref("Check"),
            "redis": ref("Check"),
        },
    },
    "Check": {"type": "object", "required": ["ok"], "properties": {"ok": BOOL, "error": STR}},
    # --- native batches (decision 0003) ---
    "NativeBatchCreate": {
        "type": "object",
        "required": ["shape", "requests"],
        "properties": {
            "shape": {"enum": ["openai", "openai_responses", "anthropic"]},
            "requests": {"type": "array", "items": OBJ, "description": "raw request bodies in `shape`"},
        },
    },
    "NativeBatchAccepted": {
        "type": "object",
        "required": ["id", "status", "total_items"],
        "properties": {"id": {"type": "string", "format": "uuid"}, "status": {"const": "queued"}, "total_items": INT},
    },
    "NativeBatchRetried": {
        "type": "object",
        "required": ["id", "status", "total_items", "retry_of", "parent_idx"],
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "status": {"const": "queued"},
            "total_items": INT,
            "retry_of": {"type": "string", "format": "uuid"},
            "parent_idx": {
                "type": "array",
                "items": INT,
                "description": "item i of the new batch re-runs item parent_idx[i] of the parent",
            },
        },
    },
    "NativeBatchStatus": {
        "type": "object",
        "required": ["ID", "Status", "TotalItems", "CreatedAt", "counts", "items"],
        "properties": {
            "ID": STR,
            "RelayKeyHash": STR,
            "PolicyID": STR,
            "InboundShape": STR,
            "Status": {"enum": ["queued", "running", "completed", "cancelled"]},
            "TotalItems": INT,
            "CreatedAt": STR,
            "CompletedAt": nullable(STR),
            "ProjectID": STR,
            "TeamID": STR,
            "PrincipalKind": STR,
            "PrincipalID": STR,
            "CredentialKind": STR,
            "CredentialID": STR,
            "counts": {"type": "object", "additionalProperties": INT},
            **LINEAGE,
            "items": {
                "type": "array",
                "items": {"type": "object", "required": ["idx", "state"], "properties": {"idx": INT, "state": STR}},
            },
        },
    },
    "NativeBatchResults": {
        "type": "object",
        "required": ["results"],
        "properties": {
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["idx", "state"],
                    "properties": {
                        "idx": INT,
                        "state": STR,
                        "response": {"description": "the upstream's answer (completed items)"},
                        "error": STR,
                        "status_code": INT,
                        "error_body": {"description": "the upstream's error body (JSON or text)"},
                    },
                },
            }
        },
    },
    "NativeBatchCancelled": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"const": "cancelled"}},
    },
    # --- OpenAI-compatible files and batches (decision 0005) ---
    "ExpiresAfter": {
        "type": "object",
        "required": ["anchor", "seconds"],
        "properties": {
            "anchor": {"const": "created_at"},
            "seconds": {"type": "integer", "minimum": 3600, "maximum": 2592000},
        },
    },
    "FileUpload": {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {"type": "string", "contentMediaType": "application/octet-stream"},
            "purpose": {"const": "batch"},
            "expires_after[anchor]": {"const": "created_at"},
            "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
        },
    },
    "File": {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status", "expires_at"],
        "properties": {
            "id": {"type": "string", "pattern": "^file-[0-9a-f]{32}$"},
            "object": {"const": "file"},
            "bytes": INT,
            "created_at": TS,
            "filename": STR,
            "purpose": {"enum": ["batch", "batch_output"]},
            "status": {"const": "processed"},
            "expires_at": nullable(TS),
            "status_details": {"type": "null"},
        },
    },
    "FileList": openai_list("File"),
    "FileDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": STR, "object": {"const": "file"}, "deleted": {"const": True}},
    },
    "BatchCreate": {
        "type": "object",
        "required": ["endpoint", "completion_window"],
        "description": "Exactly one of `input_file_id` and `requests`.",
        "properties": {
            "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]},
            "completion_window": {"const": "24h"},
            "input_file_id": STR,
            "requests": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["custom_id", "method", "url", "body"],
                    "properties": {"custom_id": STR, "method": {"const": "POST"}, "url": STR, "body": OBJ},
                },
            },
            "metadata": nullable({"type": "object", "additionalProperties": STR, "maxProperties": 16}),
            "model": STR,
            "output_expires_after": ref("ExpiresAfter"),
        },
    },
    "Batch": {
        "type": "object",
        "required": ["id", "object", "endpoint", "input_file_id", "completion_window", "status", "created_at"],
        "properties": {
            "id": {"type": "string", "pattern": "^batch_[0-9a-f]{32}$"},
            "object": {"const": "batch"},
            "endpoint": STR,
            "model": nullable(STR),
            "errors": nullable(
                {
                    "type": "object",
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "code": STR,
                                    "message": STR,
                                    "param": nullable(STR),
                                    "line": nullable(INT),
                                },
                            },
                        },
                    },
                }
            ),
            "input_file_id": STR,
            "completion_window": STR,
            "status": {
                "enum": [
                    "validating",
                    "failed",
                    "in_progress",
                    "finalizing",
                    "completed",
                    "expired",
                    "cancelling",
                    "cancelled",
                ]
            },
            "output_file_id": nullable(STR),
            "error_file_id": nullable(STR),
            **{
                k: nullable(TS)
                for k in (
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "created_at": TS,
            "request_counts": {
                "type": "object",
                "required": ["total", "completed", "failed"],
                "properties": {"total": INT, "completed": INT, "failed": INT},
            },
            "metadata": nullable({"type": "object", "additionalProperties": STR}),
            **LINEAGE,
            "usage": nullable(
                {
                    "type": "object",
                    "required": ["input_tokens", "output_tokens", "total_tokens"],
                    "properties": {
                        "input_tokens": INT,
                        "output_tokens": INT,
                        "total_tokens": INT,
                        "input_tokens_details": OBJ,
                        "output_tokens_details": OBJ,
                        "cost_nano_usd": INT,
                    },
                }
            ),
        },
    },
    "BatchList": openai_list("Batch"),
    # --- Anthropic-compatible Message Batches ---
    "AnthropicError": {
        "type": "object",
        "description": "Anthropic's error envelope (Message Batches).",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {"type": "object", "required": ["type", "message"], "properties": {"type": STR, "message": STR}},
        },
    },
    "MessageBatchCreate": {
        "type": "object",
        "required": ["requests"],
        "properties": {
            "requests": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["custom_id", "params"],
                    "properties": {
                        "custom_id": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                        "params": {"type": "object", "description": "a Messages API request body"},
                    },
                },
            }
        },
    },
    "MessageBatch": {
        "type": "object",
        "required": ["id", "type", "processing_status", "request_counts", "created_at", "expires_at"],
        "properties": {
            "id": {"type": "string", "pattern": "^msgbatch_[0-9a-f]{32}$"},
            "type": {"const": "message_batch"},
            "processing_status": {"enum": ["in_progress", "canceling", "ended"]},
            "request_counts": {
                "type": "object",
                "required": ["processing", "succeeded", "errored", "canceled", "expired"],
                "properties": {k: INT for k in ("processing", "succeeded", "errored", "canceled", "expired")},
            },
            "created_at": {"type": "string", "format": "date-time"},
            "expires_at": {"type": "string", "format": "date-time"},
            "ended_at": nullable({"type": "string", "format": "date-time"}),
            "cancel_initiated_at": nullable({"type": "string", "format": "date-time"}),
            # Set once retention archived the results (RELAY_ANTHROPIC_RESULTS_RETENTION_SECONDS).
            "archived_at": nullable({"type": "string", "format": "date-time"}),
            "results_url": nullable(STR),
            **LINEAGE,
        },
    },
    "MessageBatchList": {
        "type": "object",
        "required": ["data", "has_more", "first_id", "last_id"],
        "properties": {
            "data": {"type": "array", "items": ref("MessageBatch")},
            "has_more": BOOL,
            "first_id": nullable(STR),
            "last_id": nullable(STR),
        },
    },
    "MessageBatchDeleted": {
        "type": "object",
        "required": ["id", "type"],
        "properties": {"id": STR, "type": {"const": "message_batch_deleted"}},
    },
    # --- usage ---
    "UsageEvent": {
        "type": "object",
        "required": ["request_id", "source", "ts", "status", "duration_ms", "model", "host", "tokens"],
        "properties": {
            "request_id": STR,
            "source": {"enum": ["live", "batch"]},
            "ts": STR,
            "status": INT,
            "duration_ms": INT,
            "model": STR,
            "host": STR,
            "tokens": {"type": "object", "additionalProperties": INT},
            "cost_nano_usd": {"type": ["integer", "null"]},
            "billed_cost_nano_usd": {"type": ["integer", "null"]},
            "executed_by": {"enum": ["relay", "provider"]},
            "usage_estimated": {
                **BOOL,
                "description": "The tokens and cost are the relay's estimate, not the provider's count: a "
                "stream that ended before the provider's usage arrived (the prompt from the request's size, "
                "the output from the text relayed).",
            },
        },
        "additionalProperties": True,
    },
    "UsageEvents": {
        "type": "object",
        "required": ["events"],
        "properties": {"events": {"type": "array", "items": ref("UsageEvent")}, "next_cursor": STR},
    },
    "UsageBudgets": {
        "type": "object",
        "required": ["budgets"],
        "properties": {
            "budgets": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": [
                        "name",
                        "scope",
                        "period",
                        "enabled",
                        "usd",
                        "spent_usd",
                        "reserved_usd",
                        "left_usd",
                        "period_start",
                        "period_ends_at",
                    ],
                    "properties": {
                        "name": STR,
                        "scope": {
                            "type": "object",
                            "required": ["kind", "name"],
                            "properties": {
                                "kind": {"enum": ["project", "team", "service_account", "policy"]},
                                "name": STR,
                            },
                        },
                        "period": {"enum": ["day", "month"]},
                        "enabled": BOOL,
                        **{
                            k: {"type": "string", "description": "USD, a decimal string"}
                            for k in ("usd", "spent_usd", "reserved_usd", "left_usd")
                        },
                        "period_start": STR,
                        "period_ends_at": STR,
                    },
                    "additionalProperties": True,
                },
            }
        },
    },
    "UsageSummary": {
        "type": "object",
        "required": ["rows", "from", "to"],
        "properties": {"rows": {"type": "array", "items": OBJ}, "from": STR, "to": STR},
    },
}
