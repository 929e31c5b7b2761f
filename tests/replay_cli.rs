//! The `compactor replay` command: the real binary replays the real transcripts of
//! `tests/fixtures/transcripts/` offline with the `extractive` summarizer. One table row per
//! request the agent sent, never more tokens forwarded than received, compactions on the longer
//! transcripts, a summarizer call only where a compaction ran (session memory reuses the stored
//! summary in between), a well-formed chart, JSONL recordings, and clear errors.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

use support::{transcript, transcript_path, TRANSCRIPTS};

/// The fixtures long enough to compact under [`TUNED`].
const LONGER: [&str; 3] = [
    "swe-agent-marshmallow-function-calling.json",
    "swe-agent-ctf-katy.json",
    "swe-agent-ctf-web.json",
];

/// Thresholds lowered so the fixtures (a few thousand tokens) compact, with a verbatim tail
/// small enough that every compaction shrinks the request.
/// Background summaries are off: the table pins the request-path sequence (the replay with
/// them on is checked by `background_summaries_replay_with_one_call_per_compaction`).
const TUNED: &str =
    "[compaction]\nmax_messages = 20\nbackground_ratio = 0\nmin_preserve_tokens = 50\nmax_preserve_tokens = 400\n";

/// [`TUNED`] with background summaries on, as by default.
const TUNED_BACKGROUND: &str =
    "[compaction]\nmax_messages = 20\nbackground_ratio = 0.7\nmin_preserve_tokens = 50\nmax_preserve_tokens = 400\n";

/// Too aggressive for the `extractive` summarizer: after the first compaction each new one
/// covers one or two short messages and the refined summary outgrows them, so compactions
/// fail and the session's breaker opens. The replay must show that, not hide it.
const AGGRESSIVE: &str =
    "[compaction]\nmax_messages = 4\nbackground_ratio = 0\nmin_preserve_tokens = 10\nmax_preserve_tokens = 50\n";

/// The requests an agent sends while producing `messages`, counted independently of the
/// code under test: one before each assistant message, one more when the history does not
/// end with one.
fn expected_steps(messages: &[Value]) -> Vec<usize> {
    let mut ends: Vec<usize> = (1..messages.len())
        .filter(|&i| messages[i]["role"] == "assistant")
        .collect();
    if messages.last().is_some_and(|m| m["role"] != "assistant") {
        ends.push(messages.len());
    }
    ends
}

/// Runs `compactor <args>` in `dir` without `COMPACTOR_*` variables.
fn compactor(dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_compactor"));
    command.args(args).current_dir(dir);
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") || key == "RUST_LOG" {
            command.env_remove(key);
        }
    }
    command.output().expect("run compactor")
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write file");
    path.display().to_string()
}

/// One parsed table row.
#[derive(Debug, Clone)]
struct Row {
    step: usize,
    messages: usize,
    received: usize,
    forwarded: usize,
    compactions: usize,
    calls: usize,
    outcome: String,
}

/// One file's section of the output: its heading, rows and summary line.
#[derive(Debug)]
struct Section {
    heading: String,
    rows: Vec<Row>,
    summary: String,
}

fn parse(stdout: &str) -> Vec<Section> {
    let mut sections: Vec<Section> = Vec::new();
    for line in stdout.lines() {
        // The tables after the per-file sections (`== strategies`, `== cost`, `== probes`).
        if ["== strategies", "== cost", "== probes"]
            .iter()
            .any(|t| line.starts_with(t))
        {
            break;
        }
        if line.starts_with("== ") {
            sections.push(Section {
                heading: line.to_string(),
                rows: Vec::new(),
                summary: String::new(),
            });
            continue;
        }
        let Some(section) = sections.last_mut() else {
            panic!("output before any heading: {line}");
        };
        if line.starts_with("summary: ") {
            section.summary = line.to_string();
        } else if line.split_whitespace().next() == Some("step") {
            assert_eq!(
                line.split_whitespace().collect::<Vec<_>>(),
                [
                    "step",
                    "messages",
                    "tokens_received",
                    "tokens_forwarded",
                    "compactions",
                    "summarizer_calls",
                    "outcome"
                ]
            );
        } else if !line.trim().is_empty() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| -> usize {
                fields[i]
                    .parse()
                    .unwrap_or_else(|_| panic!("column {i} of {line:?} is not a number"))
            };
            section.rows.push(Row {
                step: n(0),
                messages: n(1),
                received: n(2),
                forwarded: n(3),
                compactions: n(4),
                calls: n(5),
                outcome: fields[6..].join(" "),
            });
        }
    }
    sections
}

/// The number before `label` in a summary line (`..., 3 compactions, ...`).
fn summary_number(summary: &str, label: &str) -> usize {
    let at = summary
        .find(&format!(" {label}"))
        .unwrap_or_else(|| panic!("no `{label}` in {summary}"));
    summary[..at]
        .rsplit([' ', ','])
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number before `{label}` in {summary}"))
}

fn run_ok(dir: &Path, args: &[&str]) -> (Vec<Section>, String) {
    let out = compactor(dir, args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (parse(&stdout), stdout)
}

/// Invariants of every replay, whatever the configuration.
fn check_section(name: &str, section: &Section, stdout: &str) {
    let expected = expected_steps(&transcript(name));
    assert!(section.heading.contains(name), "{}", section.heading);
    assert!(
        section
            .heading
            .contains("chat_completions transcript, model gpt-4o"),
        "{}",
        section.heading
    );
    assert_eq!(section.rows.len(), expected.len(), "{name}:\n{stdout}");
    let mut previous: Option<&Row> = None;
    for (row, messages) in section.rows.iter().zip(&expected) {
        let ctx = || format!("{name} step {}:\n{stdout}", row.step);
        assert_eq!(row.messages, *messages, "{}", ctx());
        assert!(row.forwarded <= row.received, "{}", ctx());
        let (compactions, calls) = previous.map_or((0, 0), |p| (p.compactions, p.calls));
        let compacted = row.outcome.starts_with("compacted #");
        let failed = row.outcome.contains("failed");
        // A compaction is counted exactly on the step that made it.
        assert_eq!(
            row.compactions,
            compactions + usize::from(compacted),
            "{}",
            ctx()
        );
        // Session memory: the summarizer is called only where a compaction ran (a failed one
        // may stop before calling it); steps that reuse the stored summary cost nothing.
        if compacted {
            assert!(row.calls > calls, "{}", ctx());
        } else if failed {
            assert!(row.calls >= calls, "{}", ctx());
        } else {
            assert_eq!(row.calls, calls, "{}", ctx());
        }
        // Masked outputs make a request smaller too: under `hybrid`, every old one when a
        // summary is due but cannot be had (the breaker is open).
        if compacted || row.outcome.starts_with("summary #") || row.outcome.contains("masked") {
            assert!(row.forwarded < row.received, "{}", ctx());
        } else {
            assert_eq!(row.forwarded, row.received, "{}", ctx());
        }
        previous = Some(row);
    }
    let last = section.rows.last().expect("rows");
    let s = &section.summary;
    assert_eq!(summary_number(s, "steps"), section.rows.len(), "{s}");
    assert_eq!(summary_number(s, "compactions"), last.compactions, "{s}");
    assert_eq!(summary_number(s, "summarizer calls"), last.calls, "{s}");
    let peak = |f: fn(&Row) -> usize| section.rows.iter().map(f).max().unwrap_or(0);
    assert!(
        s.contains(&format!(
            "peak tokens received {} vs forwarded {}",
            peak(|r| r.received),
            peak(|r| r.forwarded)
        )),
        "{s}"
    );
    assert!(
        s.contains("token threshold 108800 for gpt-4o (context window 128000"),
        "{s}"
    );
}

#[test]
fn every_transcript_replays_with_one_summary_per_compaction_and_a_chart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "replay.toml", TUNED);
    let svg = dir.path().join("replay.svg");
    let paths: Vec<String> = TRANSCRIPTS
        .iter()
        .map(|f| transcript_path(f).display().to_string())
        .collect();
    let mut args = vec!["replay", "--config", config.as_str()];
    args.extend(paths.iter().map(String::as_str));
    args.extend(["--svg", svg.to_str().expect("utf-8 path")]);
    let (sections, stdout) = run_ok(dir.path(), &args);

    assert_eq!(sections.len(), TRANSCRIPTS.len(), "{stdout}");
    let mut total = 0;
    for (name, section) in TRANSCRIPTS.iter().zip(&sections) {
        check_section(name, section, &stdout);
        let last = section.rows.last().expect("rows");
        assert!(section.summary.contains("max_messages 20"), "{stdout}");
        assert_eq!(summary_number(&section.summary, "failed compactions"), 0);
        // Every compaction succeeded here, so one summarizer call each.
        assert_eq!(last.calls, last.compactions, "{name}:\n{stdout}");
        if LONGER.contains(name) {
            assert!(last.compactions >= 1, "{name}:\n{stdout}");
            assert!(
                section
                    .rows
                    .iter()
                    .any(|r| r.outcome.starts_with("summary #")),
                "{name}: the stored summary is reused after a compaction:\n{stdout}"
            );
        }
        total += last.compactions;
    }

    let chart = std::fs::read_to_string(&svg).expect("the chart is written");
    let elements = check_well_formed(&chart).unwrap_or_else(|e| panic!("{e}\n{chart}"));
    assert_eq!(elements.first().map(String::as_str), Some("svg"));
    assert_eq!(chart.matches(r#"class="panel""#).count(), TRANSCRIPTS.len());
    assert_eq!(chart.matches(r#"class="compaction""#).count(), total);
    assert_eq!(
        chart.matches(r#"class="threshold""#).count(),
        TRANSCRIPTS.len()
    );
    assert_eq!(
        chart.matches("<polyline").count(),
        2 * TRANSCRIPTS.len(),
        "received and forwarded per panel"
    );
    for name in TRANSCRIPTS {
        assert!(chart.contains(name), "{name} is titled");
    }
}

#[test]
fn aggressive_thresholds_show_failed_compactions_without_extra_summaries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "replay.toml", AGGRESSIVE);
    let (mut total_failed, mut total_compacted) = (0, 0);
    for name in TRANSCRIPTS {
        let path = transcript_path(name).display().to_string();
        let (sections, stdout) = run_ok(dir.path(), &["replay", "--config", &config, &path]);
        assert_eq!(sections.len(), 1, "{stdout}");
        let section = &sections[0];
        check_section(name, section, &stdout);
        let failed = section
            .rows
            .iter()
            .filter(|r| {
                r.outcome.contains("new compaction failed")
                    || r.outcome.contains("compaction failed,")
            })
            .count();
        assert_eq!(
            summary_number(&section.summary, "failed compactions"),
            failed,
            "{stdout}"
        );
        // At 4 messages the rewrite is the system prompt, the task (kept verbatim), the summary
        // and the last message: where the early slices are short tool rounds, no rewrite is
        // smaller, so those compactions fail (each failure shown) and the breaker stops the
        // attempts; the others compact.
        let compacted = section.rows.last().expect("rows").compactions;
        assert!(compacted >= 1 || failed > 0, "{stdout}");
        total_compacted += compacted;
        total_failed += failed;
    }
    assert!(
        total_failed > 0,
        "these thresholds make compactions fail; the replay must show it"
    );
    assert!(total_compacted > 0, "and some still compact");
}

#[test]
fn a_jsonl_of_requests_replays_line_by_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "replay.toml", TUNED);
    let name = "swe-agent-marshmallow-function-calling.json";
    let all = transcript(name);
    let ends = expected_steps(&all);
    let lines: String = ends
        .iter()
        .map(|&end| {
            let request = json!({"model": "gpt-4o", "stream": true, "messages": all[..end]});
            format!("{request}\n")
        })
        .collect();
    let jsonl = write(dir.path(), "requests.jsonl", &lines);
    let transcript = transcript_path(name).display().to_string();
    let (sections, stdout) = run_ok(
        dir.path(),
        &["replay", "--config", &config, &jsonl, &transcript],
    );
    assert_eq!(sections.len(), 2, "{stdout}");
    let (requests, replayed) = (&sections[0], &sections[1]);
    assert!(
        requests
            .heading
            .contains("chat_completions requests, model gpt-4o"),
        "{stdout}"
    );
    check_section_rows_match(requests, replayed, &stdout);
    assert!(
        requests.rows.last().expect("rows").compactions >= 1,
        "{stdout}"
    );

    // Other dialects are detected per line; under every threshold they are forwarded as
    // received, whether or not the engine compacts them yet.
    let mixed = [
        json!({"model": "claude-sonnet-4-5", "max_tokens": 1024, "system": "Be brief.",
               "messages": [{"role": "user", "content": "hello"}]}),
        json!({"model": "gpt-4o", "input": [{"role": "user", "content": "hello"}]}),
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]}),
    ];
    let text: String = mixed.iter().map(|l| format!("{l}\n")).collect();
    let path = write(dir.path(), "mixed.jsonl", &text);
    let (sections, stdout) = run_ok(dir.path(), &["replay", &path]);
    assert_eq!(sections.len(), 1, "{stdout}");
    assert!(sections[0].heading.contains("(mixed requests"), "{stdout}");
    assert_eq!(sections[0].rows.len(), 3, "{stdout}");
    for row in &sections[0].rows {
        assert_eq!(row.forwarded, row.received, "{stdout}");
        assert!(row.received > 0, "{stdout}");
        assert_eq!((row.compactions, row.calls), (0, 0), "{stdout}");
    }
}

/// The same requests give the same table, whether recorded as JSONL or cut from a transcript.
fn check_section_rows_match(a: &Section, b: &Section, stdout: &str) {
    assert_eq!(a.rows.len(), b.rows.len(), "{stdout}");
    for (x, y) in a.rows.iter().zip(&b.rows) {
        assert_eq!(
            (
                x.step,
                x.messages,
                x.received,
                x.forwarded,
                x.compactions,
                x.calls
            ),
            (
                y.step,
                y.messages,
                y.received,
                y.forwarded,
                y.compactions,
                y.calls
            ),
            "{stdout}"
        );
        assert_eq!(x.outcome, y.outcome, "{stdout}");
    }
}

#[test]
fn missing_or_invalid_inputs_fail_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let present = transcript_path(TRANSCRIPTS[0]).display().to_string();
    let out = compactor(dir.path(), &["replay", &present, "no-such-transcript.json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot read no-such-transcript.json"),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing is replayed when a file is missing"
    );

    let bad = write(dir.path(), "bad.json", r#"{"prompt": "hi"}"#);
    let out = compactor(dir.path(), &["replay", &bad]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("bad.json") && stderr.contains("`messages`"),
        "{stderr}"
    );

    let out = compactor(dir.path(), &["replay", "--summarizer", "nope", &present]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("`nope`"), "{stderr}");

    let out = compactor(dir.path(), &["replay"]);
    assert!(!out.status.success(), "a transcript is required");
}

/// The chart's element names in document order, when it parses as XML.
fn check_well_formed(doc: &str) -> Result<Vec<String>, String> {
    let doc = roxmltree::Document::parse(doc).map_err(|e| e.to_string())?;
    Ok(doc
        .descendants()
        .filter(|n| n.is_element())
        .map(|n| n.tag_name().name().to_string())
        .collect())
}

#[test]
fn background_summaries_replay_with_one_call_per_compaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "replay.toml", TUNED_BACKGROUND);
    let paths: Vec<String> = TRANSCRIPTS
        .iter()
        .map(|f| transcript_path(f).display().to_string())
        .collect();
    let mut args = vec!["replay", "--config", config.as_str()];
    args.extend(paths.iter().map(String::as_str));
    let (sections, stdout) = run_ok(dir.path(), &args);
    assert_eq!(sections.len(), TRANSCRIPTS.len(), "{stdout}");
    for (name, section) in TRANSCRIPTS.iter().zip(&sections) {
        let last = section.rows.last().expect("rows");
        assert_eq!(summary_number(&section.summary, "failed compactions"), 0);
        // Summaries made ahead of need are each stored, never wasted here: one call each.
        assert_eq!(last.calls, last.compactions, "{name}:\n{stdout}");
        let mut previous = 0;
        for row in &section.rows {
            // A compaction is made where the table says a background summary started.
            let made = row.outcome.ends_with("summary made in the background");
            assert_eq!(
                row.compactions,
                previous + usize::from(made),
                "{name}:\n{stdout}"
            );
            assert!(
                !row.outcome.starts_with("compacted #"),
                "{name}: every compaction was made ahead of need, none on a request:\n{stdout}"
            );
            previous = row.compactions;
        }
        if LONGER.contains(name) {
            assert!(last.compactions >= 1, "{name}:\n{stdout}");
            assert!(
                section
                    .rows
                    .iter()
                    .any(|r| r.outcome.starts_with("summary #")),
                "{name}: the request crossing the trigger splices the summary:\n{stdout}"
            );
        }
    }
}

/// README's `compactor replay` example is what the binary prints today: with the settings the
/// README names, every line of its example (`...` standing for rows left out) is in the output.
#[test]
fn the_readme_replay_example_is_what_the_binary_prints() {
    let readme = include_str!("../README.md");
    let start = readme
        .find("```\n== tests/fixtures/transcripts/swe-agent-ctf-web.json")
        .expect("README's replay example");
    let block = &readme[start + 4..];
    let block = &block[..block.find("```").expect("end of the example")];
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("my.toml");
    std::fs::write(
        &config,
        "[compaction]\nmax_messages = 20\nmin_preserve_tokens = 50\nmax_preserve_tokens = 400\n",
    )
    .expect("write config");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["replay", "--config"])
        .arg(&config)
        .arg("tests/fixtures/transcripts/swe-agent-ctf-web.json")
        .current_dir(root)
        .output()
        .expect("run compactor replay");
    let printed = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = printed.lines().collect();
    for line in block.lines().filter(|l| *l != "...") {
        assert!(
            lines.contains(&line),
            "README's example line is not printed today:\n{line}\n\nthe binary prints:\n{printed}"
        );
    }
}

/// A transcript in Gemini's shape (`systemInstruction`, `contents` of `user` and `model`
/// entries with `functionCall` / `functionResponse` parts) is recognised by its shape and
/// replayed as Gemini requests at the default Gemini model: one request before each model
/// entry, compactions on the way, the stored summary reused after each, never more forwarded
/// than received.
#[test]
fn a_gemini_transcript_replays_as_gemini_requests() {
    let messages = transcript("swe-agent-marshmallow-function-calling.json");
    let (system, rest) = messages.split_first().expect("a system prompt");
    let mut contents: Vec<Value> = Vec::new();
    for m in rest {
        let text = m["content"].as_str().unwrap_or_default();
        match m["role"].as_str() {
            Some("assistant") => {
                let mut parts = vec![json!({"text": text})];
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    let args: Value = serde_json::from_str(
                        call["function"]["arguments"].as_str().unwrap_or("{}"),
                    )
                    .unwrap_or(json!({}));
                    parts.push(json!({"functionCall": {"id": call["id"],
                        "name": call["function"]["name"], "args": args}}));
                }
                contents.push(json!({"role": "model", "parts": parts}));
            }
            Some("tool") => {
                let part = json!({"functionResponse": {"id": m["tool_call_id"],
                    "name": m["name"].as_str().unwrap_or("tool"),
                    "response": {"output": text}}});
                // Parallel calls are answered in one user entry.
                match contents.last_mut() {
                    Some(last)
                        if last["role"] == "user"
                            && last["parts"][0].get("functionResponse").is_some() =>
                    {
                        last["parts"].as_array_mut().expect("parts").push(part);
                    }
                    _ => contents.push(json!({"role": "user", "parts": [part]})),
                }
            }
            _ => contents.push(json!({"role": "user", "parts": [{"text": text}]})),
        }
    }
    let model_entries = contents.iter().filter(|c| c["role"] == "model").count();
    let ends_on_model = contents.last().is_some_and(|c| c["role"] == "model");
    let gemini = json!({
        "systemInstruction": {"parts": [{"text": system["content"]}]},
        "contents": contents,
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(dir.path(), "replay.toml", TUNED);
    let file = write(dir.path(), "gemini.json", &gemini.to_string());
    let (sections, stdout) = run_ok(dir.path(), &["replay", "--config", &config, &file]);
    assert_eq!(sections.len(), 1, "{stdout}");
    let section = &sections[0];
    assert!(
        section
            .heading
            .contains("gemini transcript, model gemini-2.5-pro"),
        "{}",
        section.heading
    );
    assert_eq!(
        section.rows.len(),
        model_entries + usize::from(!ends_on_model),
        "{stdout}"
    );
    let last = section.rows.last().expect("rows");
    assert!(last.compactions >= 1, "{stdout}");
    assert_eq!(last.calls, last.compactions, "{stdout}");
    assert!(
        section
            .rows
            .iter()
            .any(|r| r.outcome.starts_with("summary #")),
        "the stored summary is reused:\n{stdout}"
    );
    assert!(
        section.rows.iter().all(|r| r.forwarded <= r.received),
        "{stdout}"
    );
    assert!(
        section
            .summary
            .contains("for gemini-2.5-pro (context window 1048576"),
        "the path's model decides the window: {}",
        section.summary
    );
}
