"""What a stream cut before the provider's usage is billed (gateway.streaming.Events,
gateway.pipeline.finish_stream): the output estimated from the deltas relayed, measured against the fake
provider's own counts at every point a stream can be cut, on each provider's event format. No server: the fake's
events are fed to the cutter."""

import pytest

from devkit.upstream import canned, canned_events
from gateway import streaming

pytestmark = pytest.mark.unit

LONG = (
    "Summarize the quarterly report: revenue grew 12% to $4.1M, churn fell to 2.3%, and the new "
    "enterprise tier signed 14 customers, including two Fortune 500 companies. Keep it short, please."
)
BODIES = {
    "/v1/chat/completions": ("openai", {"model": "m", "messages": [{"role": "user", "content": LONG}]}),
    "/v1/completions": ("openai", {"model": "m", "prompt": LONG}),
    "/v1/responses": ("openai_responses", {"model": "m", "input": LONG}),
    "/v1/messages": ("anthropic", {"model": "m", "max_tokens": 500, "messages": [{"role": "user", "content": LONG}]}),
}


def produced(path: str, body: dict) -> int:
    """The output tokens the fake provider counts for its whole answer."""
    usage = canned(path, body)["usage"]
    return usage.get("completion_tokens", usage.get("output_tokens"))


@pytest.mark.parametrize("path", list(BODIES))
def test_the_estimate_of_a_cut_stream_is_within_a_quarter_of_what_the_provider_had_produced(path):
    adapter, body = BODIES[path]
    # What the relay sends upstream (usage asked for on OpenAI's chunk shapes), as the fake streams it.
    events, first = canned_events(path, streaming.upstream_body(path, dict(body, stream=True))[0])
    total = produced(path, body)
    deltas = [i for i in range(first, len(events)) if i - first < total]  # the content events, one word each
    assert len(deltas) == total
    for cut in range(1, total + 1):  # the provider had produced `cut` tokens (its count: one per word)
        cutter = streaming.Events(adapter, path, strip_usage_chunk=True)
        for event in events[: first + cut]:
            cutter.feed(event)
        assert not cutter.final
        assert abs(cutter.relayed_output - cut) <= 0.25 * cut + 1, (cut, cutter.relayed_output)
    # The whole answer: within a quarter of the provider's count, and the provider's count is final.
    cutter = streaming.Events(adapter, path, strip_usage_chunk=True)
    for event in events:
        cutter.feed(event)
    assert cutter.final and cutter.tokens.output == total
    assert abs(cutter.relayed_output - total) <= 0.25 * total, (total, cutter.relayed_output)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_cut_before_any_content_estimates_no_output(path):
    adapter, body = BODIES[path]
    events, first = canned_events(path, dict(body, stream=True))
    cutter = streaming.Events(adapter, path, strip_usage_chunk=True)
    for event in events[:first]:
        cutter.feed(event)
    assert (cutter.final, cutter.relayed_output) == (False, 0)


def test_tool_call_arguments_and_reasoning_count_and_the_done_events_do_not_count_twice():
    chat = streaming.Events("openai", "/v1/chat/completions", strip_usage_chunk=True)
    chat.feed(
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":"{\\"city\\": \\"Paris\\"}"}}]}}]}\n\n'
    )
    assert chat.relayed_output == 5  # 21 bytes of JSON text (escapes kept): 5 tokens
    responses = streaming.Events("openai_responses", "/v1/responses", strip_usage_chunk=True)
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hello"}\n\n'
    responses.feed(delta)
    done = b'event: response.output_text.done\ndata: {"type":"response.output_text.done","text":"Hello there"}\n\n'
    responses.feed(done)
    assert responses.relayed_output == 1
    anthropic = streaming.Events("anthropic", "/v1/messages", strip_usage_chunk=True)
    anthropic.feed(
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"thinking_delta","thinking":"Let me think about the weather in Paris."}}\n\n'
    )
    anthropic.feed(
        b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        b'"content_block":{"type":"text","text":"ignored: not a delta"}}\n\n'
    )
    assert anthropic.relayed_output == 10  # 40 bytes: a delta of several tokens counts a token per 4 bytes


def test_responses_audio_deltas_are_not_measured_as_text():
    cutter = streaming.Events("openai_responses", "/v1/responses", strip_usage_chunk=True)
    audio = b'{"type":"response.audio.delta","delta":"' + b"QUJD" * 500 + b'"}'
    cutter.feed(b"event: response.audio.delta\ndata: " + audio + b"\n\n")
    assert cutter.relayed_output == 0
