"""The official `openai` SDK's Responses API through compactor, used statelessly the way Codex
uses it (`store=False`, encrypted reasoning carried in `input`).

Run by tests/official_sdks.rs with the venv of scripts/sdk-venv: argv is the base URL
(`http://127.0.0.1:PORT/v1`) and a fake API key. Makes four calls, in order: a tool loop turn
(non-streaming), the next turn streamed, then a long conversation that compactor compacts
(non-streaming) and its next turn (streamed). Prints one JSON object: what the SDK returned
for each call and the input it was given.
"""

import json
import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=15)

TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
        "strict": False,
    }
]


def user(text):
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text):
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


TURN = [
    user("Fix the failing test."),
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB-enc-1"},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "shell",
        "arguments": '{"cmd": "cat a.py"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "def f(): return 1"},
]


def params(items):
    return dict(
        model="gpt-5-codex",
        instructions="You are Codex, a coding agent.",
        input=items,
        tools=TOOLS,
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "low"},
    )


def summary(r):
    return {
        "id": r.id,
        "status": r.status,
        "output_types": [o.type for o in r.output],
        "output_text": r.output_text,
        "reasoning": [
            {"id": o.id, "encrypted_content": o.encrypted_content}
            for o in r.output
            if o.type == "reasoning"
        ],
        "calls": [
            {"call_id": o.call_id, "name": o.name, "arguments": json.loads(o.arguments)}
            for o in r.output
            if o.type == "function_call"
        ],
        "total_tokens": r.usage.total_tokens if r.usage else None,
    }


def plain(items):
    raw = client.responses.with_raw_response.create(**params(items))
    r = raw.parse()
    return {
        "sent": items,
        "compacted": raw.headers.get("x-compactor-compacted"),
        "request_id": r._request_id,
        **summary(r),
    }


def streamed(items):
    raw = client.responses.with_raw_response.create(**params(items), stream=True)
    events, text, final = [], "", None
    for event in raw.parse():
        events.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    return {
        "sent": items,
        "compacted": raw.headers.get("x-compactor-compacted"),
        "events": events,
        "deltas": text,
        **summary(final),
    }


def long_conversation():
    """30 items: turns, a call and its output among them, ending with the user's question."""
    items = []
    for i in range(13):
        items.append(user(f"Step {i}: look at module_{i}.py. " + "detail " * 30))
        items.append(assistant(f"Module {i} reviewed. " + "finding " * 30))
    items.append(user("Show me the config."))
    items.append(
        {
            "type": "function_call",
            "id": "fc_9",
            "call_id": "call_9",
            "name": "shell",
            "arguments": '{"cmd": "cat config.toml"}',
        }
    )
    items.append({"type": "function_call_output", "call_id": "call_9", "output": "port = 8080"})
    items.append(user("Now summarise what you found in module 12, please."))
    return items


out = {"sdk_version": openai.__version__, "plain": plain(TURN)}
# The next request carries the answer's items back (reasoning with its encrypted content, the
# call) and the call's output, as a stateless client does.
plain_out = out["plain"]
turn = (
    TURN
    + [
        {"type": "reasoning", "id": r["id"], "summary": [], "encrypted_content": r["encrypted_content"]}
        for r in plain_out["reasoning"]
    ]
    + [
        {"type": "function_call", "call_id": c["call_id"], "name": c["name"],
         "arguments": json.dumps(c["arguments"])}
        for c in plain_out["calls"]
    ]
    + [{"type": "function_call_output", "call_id": plain_out["calls"][0]["call_id"], "output": "3 passed"}]
)
out["streamed"] = streamed(turn)

history = long_conversation()
out["compacted_plain"] = plain(history)
history = history + [assistant(out["compacted_plain"]["output_text"]), user("And module 11?")]
out["compacted_streamed"] = streamed(history)
print(json.dumps(out))
