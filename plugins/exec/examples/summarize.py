#!/usr/bin/env python3
"""A minimal compactor `exec` summarizer (Python 3, standard library only).

Protocol (see plugins/README.md): one JSON request on stdin, one JSON object
`{"summary": "..."}` on stdout, exit status 0. Anything on stderr ends up in
compactor's log at warn level; a non-zero exit fails the attempt.

This example writes a small deterministic summary: the user's messages, the
files touched and the latest assistant text. Replace `summarize` with a call
to your own model or service.

    [summarizer]
    backend = "exec"
    [summarizer.exec]
    command = "python3"
    args = ["plugins/exec/examples/summarize.py"]
"""

import json
import sys

SUPPORTED_VERSION = 1
MAX_CHARS = 300


def clip(text, limit=MAX_CHARS):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def texts(entry):
    return [p["text"] for p in entry["parts"] if p["type"] == "text" and p["text"].strip()]


def summarize(request):
    users = [" ".join(texts(e)) for e in request["entries"] if e["role"] == "user"]
    users = [u for u in users if u.strip()]
    assistant = [" ".join(texts(e)) for e in request["entries"] if e["role"] == "assistant"]
    assistant = [a for a in assistant if a.strip()]

    lines = ["Summary of compaction #%d (example exec plugin)." % request["compaction_num"]]
    if request.get("instructions"):
        lines.append("Focus: " + clip(request["instructions"]))
    lines.append("")
    lines.append("1. Primary Request and Intent:")
    lines.append("   - " + (clip(users[0]) if users else "none recorded"))
    lines.append("")
    lines.append("3. Files and Code Sections:")
    lines.append("   - Read: " + (", ".join(request["read_files"]) or "none"))
    lines.append("   - Modified: " + (", ".join(request["modified_files"]) or "none"))
    lines.append("")
    lines.append("6. All user messages:")
    for i, message in enumerate(users, 1):
        lines.append("   %d. %s" % (i, clip(message)))
    lines.append("")
    lines.append("8. Current Work:")
    lines.append("   - " + (clip(assistant[-1]) if assistant else "none recorded"))
    if request.get("prior_summary"):
        lines.append("")
        lines.append("Prior summary (carried forward):")
        lines.append(request["prior_summary"])
    return "\n".join(lines)


def main():
    try:
        request = json.load(sys.stdin)
    except ValueError as e:
        print("summarize.py: stdin is not JSON: %s" % e, file=sys.stderr)
        return 2
    if request.get("version") != SUPPORTED_VERSION:
        print("summarize.py: unsupported protocol version %r" % request.get("version"),
              file=sys.stderr)
        return 3
    json.dump({"summary": summarize(request)}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
