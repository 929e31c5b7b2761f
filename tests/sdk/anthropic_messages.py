"""The official `anthropic` SDK's Messages API through compactor.

Run by tests/official_sdks.rs with the venv of scripts/sdk-venv: argv is the base URL
(`http://127.0.0.1:PORT`) and a fake API key. Makes four calls, in order: a tool loop turn
(non-streaming), the next turn streamed with the SDK's `messages.stream` helper, then a long
conversation that compactor compacts (non-streaming) and its next turn (streamed). Prints one
JSON object: what the SDK returned for each call and the messages it was given.
"""

import json
import sys

import anthropic

base_url, api_key = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=15)

SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {
        "type": "text",
        "text": "Work in /repo. Run tests before you finish.",
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS = [
    {
        "name": "bash",
        "description": "Run a command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]

TURN = [
    {"role": "user", "content": "Run the tests."},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Running them."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "pytest"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "2 failed, 40 passed",
                "cache_control": {"type": "ephemeral"},
            }
        ],
    },
]


def blocks(message):
    out = []
    for b in message.content:
        if b.type == "text":
            out.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            out.append({"type": "tool_use", "id": b.id, "name": b.name, "input": b.input})
        else:
            out.append({"type": b.type})
    return out


def params(messages):
    return dict(
        model="claude-sonnet-4-5", max_tokens=1024, system=SYSTEM, tools=TOOLS, messages=messages
    )


def plain(messages):
    raw = client.messages.with_raw_response.create(**params(messages))
    m = raw.parse()
    return {
        "sent": messages,
        "compacted": raw.headers.get("x-compactor-compacted"),
        "request_id": m._request_id,
        "id": m.id,
        "content": blocks(m),
        "stop_reason": m.stop_reason,
        "usage": {
            "input_tokens": m.usage.input_tokens,
            "output_tokens": m.usage.output_tokens,
            "cache_read_input_tokens": m.usage.cache_read_input_tokens,
        },
    }


def streamed(messages):
    with client.messages.stream(**params(messages)) as stream:
        text = "".join(stream.text_stream)
        m = stream.get_final_message()
        headers = stream.response.headers
    return {
        "sent": messages,
        "compacted": headers.get("x-compactor-compacted"),
        "request_id": headers.get("request-id"),
        "text": text,
        "id": m.id,
        "content": blocks(m),
        "stop_reason": m.stop_reason,
        "usage": {"input_tokens": m.usage.input_tokens, "output_tokens": m.usage.output_tokens},
    }


def long_conversation():
    """31 messages, a tool use and its result among them, ending with the user's question."""
    m = []
    for i in range(14):
        m.append({"role": "user", "content": f"Step {i}: look at module_{i}.py. " + "detail " * 30})
        m.append({"role": "assistant", "content": f"Module {i} reviewed. " + "finding " * 30})
    m.append({"role": "user", "content": "Show me the config."})
    m.append(
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_9", "name": "bash",
                 "input": {"command": "cat config.toml"}}
            ],
        }
    )
    m.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_9", "content": "port = 8080"},
                {"type": "text", "text": "Now summarise what you found in module 13, please."},
            ],
        }
    )
    return m


out = {"sdk_version": anthropic.__version__}
out["anthropic_version"] = client.default_headers["anthropic-version"]
out["plain"] = plain(TURN)
# The next request carries the answer back, and the result of its tool use.
answer = out["plain"]["content"]
use = next(b for b in answer if b["type"] == "tool_use")
turn = TURN + [
    {"role": "assistant", "content": answer},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use["id"], "content": "42 passed"}]},
]
out["streamed"] = streamed(turn)

history = long_conversation()
out["compacted_plain"] = plain(history)
history = history + [
    {"role": "assistant", "content": out["compacted_plain"]["content"]},
    {"role": "user", "content": "And module 12?"},
]
out["compacted_streamed"] = streamed(history)
print(json.dumps(out))
