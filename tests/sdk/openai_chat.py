"""The official `openai` SDK's Chat Completions API through compactor.

Run by tests/official_sdks.rs with the venv of scripts/sdk-venv: argv is the base URL
(`http://127.0.0.1:PORT/v1`) and a fake API key. Makes four calls, in order: a tool loop turn
(non-streaming), the next turn streamed, then a long conversation that compactor compacts
(non-streaming) and its next turn (streamed). Prints one JSON object: what the SDK returned
for each call and the messages it was given.
"""

import json
import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=15)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"],
            },
        },
    }
]

TURN = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Run the unit tests."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "shell", "arguments": '{"cmd": "pytest tests/unit"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "2 failed, 40 passed"},
]


def plain(messages):
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=messages, tools=TOOLS
    )
    c = raw.parse()
    message = c.choices[0].message
    return {
        "sent": messages,
        "compacted": raw.headers.get("x-compactor-compacted"),
        "request_id": c._request_id,
        "id": c.id,
        "finish_reason": c.choices[0].finish_reason,
        "content": message.content,
        "tool_calls": [
            {"id": t.id, "name": t.function.name, "arguments": json.loads(t.function.arguments)}
            for t in message.tool_calls or []
        ],
        "total_tokens": c.usage.total_tokens if c.usage else None,
    }


def streamed(messages):
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, calls, finish, total, chunks = "", {}, None, None, 0
    for chunk in raw.parse():
        chunks += 1
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
        if chunk.usage:
            total = chunk.usage.total_tokens
    return {
        "sent": messages,
        "compacted": raw.headers.get("x-compactor-compacted"),
        "chunks": chunks,
        "content": text,
        "finish_reason": finish,
        "tool_calls": [
            {"id": c["id"], "name": c["name"], "arguments": json.loads(c["arguments"])}
            for _, c in sorted(calls.items())
        ],
        "total_tokens": total,
    }


def long_conversation():
    """33 messages: a system prompt, turns, a tool call and its result, the user's question."""
    m = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(14):
        m.append({"role": "user", "content": f"Step {i}: look at module_{i}.py. " + "detail " * 30})
        m.append({"role": "assistant", "content": f"Module {i} reviewed. " + "finding " * 30})
    m.append({"role": "user", "content": "Show me the config."})
    m.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "shell", "arguments": '{"cmd": "cat config.toml"}'},
                }
            ],
        }
    )
    m.append({"role": "tool", "tool_call_id": "call_9", "content": "[server]\nport = 8080\n"})
    m.append({"role": "user", "content": "Now summarise what you found in module 13, please."})
    return m


out = {"sdk_version": openai.__version__, "plain": plain(TURN)}
# The next request carries the answer's tool call back, and its result.
calls = out["plain"]["tool_calls"]
turn = TURN + [
    {
        "role": "assistant",
        "content": out["plain"]["content"],
        "tool_calls": [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ],
    },
    {"role": "tool", "tool_call_id": calls[0]["id"], "content": "42 passed"},
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
