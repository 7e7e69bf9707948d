"""Token parsing for every adapter's usage shape, cached tokens, and garbage that must count as zero."""

import pytest

from usage.tokens import Tokens, parse_usage


def test_chat_completions_takes_cached_tokens_out_of_the_prompt():
    body = {
        "usage": {
            "prompt_tokens": 1200,
            "completion_tokens": 300,
            "total_tokens": 1500,
            "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 200},
        }
    }
    tokens = parse_usage("openai", "/v1/chat/completions", body)
    # Reasoning is already inside completion_tokens: not added again.
    assert tokens == Tokens(input=176, output=300, cache_read=1024, cache_write=0)
    assert tokens.total == 1500


def test_legacy_completions_without_details():
    body = {"usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
    assert parse_usage("openai", "/v1/completions", body) == Tokens(input=5, output=7)


def test_null_details_from_openai_compatible_servers():
    body = {"usage": {"prompt_tokens": 5, "completion_tokens": 7, "prompt_tokens_details": None}}
    assert parse_usage("openai", "/v1/chat/completions", body) == Tokens(input=5, output=7)


def test_embeddings_count_only_input():
    body = {"object": "list", "usage": {"prompt_tokens": 8, "total_tokens": 8}}
    assert parse_usage("openai", "/v1/embeddings", body) == Tokens(input=8)


def test_responses_api():
    body = {
        "usage": {
            "input_tokens": 2000,
            "input_tokens_details": {"cached_tokens": 1500},
            "output_tokens": 400,
            "output_tokens_details": {"reasoning_tokens": 350},
            "total_tokens": 2400,
        }
    }
    tokens = parse_usage("openai_responses", "/v1/responses", body)
    assert tokens == Tokens(input=500, output=400, cache_read=1500)
    assert tokens.total == 2400


def test_anthropic_input_is_already_uncached():
    body = {
        "type": "message",
        "usage": {
            "input_tokens": 50,
            "cache_creation_input_tokens": 2048,
            "cache_read_input_tokens": 4096,
            "output_tokens": 120,
        },
    }
    tokens = parse_usage("anthropic", "/v1/messages", body)
    assert tokens == Tokens(input=50, output=120, cache_read=4096, cache_write=2048)
    assert tokens.total == 50 + 120 + 4096 + 2048


def test_anthropic_null_cache_fields():
    body = {"usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": None}}
    assert parse_usage("anthropic", "/v1/messages", body) == Tokens(input=10, output=3)


def test_query_string_and_trailing_slash_on_the_path():
    body = {"usage": {"prompt_tokens": 8}}
    assert parse_usage("openai", "/v1/embeddings/?x=1", body) == Tokens(input=8)


def test_cached_above_prompt_is_capped_so_the_total_matches_the_prompt():
    body = {"usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 50}}}
    assert parse_usage("openai", "/v1/chat/completions", body) == Tokens(input=0, output=1, cache_read=10)


@pytest.mark.parametrize(
    "body",
    [
        {},
        None,
        [],
        "usage",
        {"usage": None},
        {"usage": "lots"},
        {"usage": []},
        {"usage": {"prompt_tokens": "12", "completion_tokens": 3.5}},
        {"usage": {"prompt_tokens": True, "completion_tokens": None}},
        {"usage": {"prompt_tokens": -5, "completion_tokens": -1, "prompt_tokens_details": {"cached_tokens": -3}}},
        {"usage": {"prompt_tokens_details": "x", "completion_tokens_details": 7}},
    ],
)
@pytest.mark.parametrize(
    "adapter,path",
    [
        ("openai", "/v1/chat/completions"),
        ("openai", "/v1/completions"),
        ("openai", "/v1/embeddings"),
        ("openai_responses", "/v1/responses"),
        ("anthropic", "/v1/messages"),
    ],
)
def test_garbage_counts_as_zero(adapter, path, body):
    assert parse_usage(adapter, path, body) == Tokens()


def test_garbage_fields_next_to_good_ones():
    body = {"usage": {"input_tokens": 10, "output_tokens": "many", "cache_read_input_tokens": -4}}
    assert parse_usage("anthropic", "/v1/messages", body) == Tokens(input=10)


def test_unknown_adapter_counts_nothing():
    assert parse_usage("gemini", "/v1/chat/completions", {"usage": {"prompt_tokens": 5}}) == Tokens()


def test_tokens_are_immutable_and_total_adds_every_meter():
    tokens = Tokens(input=1, output=2, cache_read=3, cache_write=4)
    assert tokens.total == 10
    assert Tokens().total == 0
    with pytest.raises(AttributeError):
        tokens.input = 5
