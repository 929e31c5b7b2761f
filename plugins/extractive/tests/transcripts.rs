//! The `extractive` backend on the real SWE-agent transcripts of `tests/fixtures/transcripts/`
//! (SWE-agent, MIT): every user message and the errors must survive, in order, the files are
//! counted, and the output must not depend on anything but the request.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use compactor_plugin_api::{
    split_user_text, Caller, Entry, Part, Role, Summarizer, SummaryRequest,
};
use compactor_plugin_extractive::{extract, ExtractiveConfig, ExtractiveSummarizer};

const MAX_CHARS: usize = 200;

const SECTIONS: [&str; 9] = [
    "1. Primary Request and Intent:",
    "2. Key Technical Concepts:",
    "3. Files and Code Sections:",
    "4. Errors and fixes:",
    "5. Problem Solving:",
    "6. All user messages:",
    "7. Pending Tasks:",
    "8. Current Work:",
    "9. Optional Next Step:",
];

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/transcripts");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let names: Vec<_> = files
        .iter()
        .filter_map(|p| p.file_name()?.to_str())
        .collect();
    assert_eq!(
        names,
        [
            "swe-agent-ctf-katy.json",
            "swe-agent-ctf-web.json",
            "swe-agent-function-calling-simple.json",
            "swe-agent-marshmallow-function-calling.json",
        ],
        "the transcripts in {}",
        dir.display()
    );
    files
}

/// Chat Completions messages → entries: user text; assistant text and tool calls, with the
/// following `tool` messages attached to that assistant turn as results.
fn entries(messages: &[Value]) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    let mut pending_calls: Vec<String> = Vec::new();
    for m in messages {
        let content = m["content"].as_str().unwrap_or_default().to_owned();
        match m["role"].as_str() {
            Some("user") => out.push(Entry {
                role: Role::User,
                parts: vec![Part::Text { text: content }],
            }),
            Some("assistant") => {
                let mut parts = Vec::new();
                if !content.is_empty() {
                    parts.push(Part::Text { text: content });
                }
                pending_calls.clear();
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    let name = call["function"]["name"].as_str().unwrap_or("?").to_owned();
                    pending_calls.push(name.clone());
                    parts.push(Part::ToolCall {
                        name,
                        arguments: call["function"]["arguments"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    });
                }
                out.push(Entry {
                    role: Role::Assistant,
                    parts,
                });
            }
            Some("tool") => {
                let name = if pending_calls.is_empty() {
                    "?".to_owned()
                } else {
                    pending_calls.remove(0)
                };
                let last = out
                    .last_mut()
                    .expect("a tool result follows an assistant turn");
                assert_eq!(last.role, Role::Assistant);
                last.parts.push(Part::ToolResult {
                    name,
                    output: content,
                    is_error: false,
                });
            }
            _ => {} // the system prompt is not summarised
        }
    }
    out
}

/// Paths named by `open`/`create` calls, plus one fixed entry each so every transcript has some.
fn files(entries: &[Entry]) -> (Vec<String>, Vec<String>) {
    let mut read = vec!["README.md".to_owned()];
    let mut modified = vec!["CHANGELOG.md".to_owned()];
    for part in entries.iter().flat_map(|e| &e.parts) {
        if let Part::ToolCall { name, arguments } = part {
            let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
            match (
                name.as_str(),
                args["path"].as_str(),
                args["filename"].as_str(),
            ) {
                ("open", Some(p), _) if !read.iter().any(|r| r == p) => read.push(p.to_owned()),
                ("create", _, Some(p)) if !modified.iter().any(|m| m == p) => {
                    modified.push(p.to_owned())
                }
                _ => {}
            }
        }
    }
    (read, modified)
}

fn request(path: &Path) -> SummaryRequest {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let entries = entries(doc["messages"].as_array().expect("messages"));
    let (read_files, modified_files) = files(&entries);
    SummaryRequest {
        in_conversation: None,
        prompt: "(the rendered prompt; the extractive backend does not read it)".into(),
        prior_summary: Some("PRIOR: the user first asked to set up the repository.".into()),
        entries,
        read_files,
        modified_files,
        instructions: Some("keep the exact commands".into()),
        compaction_num: 2,
        model: doc["model"].as_str().map(str::to_owned),
        max_output_tokens: 0,
        timeout: Duration::from_secs(5),
        caller: Caller::default(),
    }
}

fn normalized(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The own words of every user turn (the SWE-agent transcripts inject no context, so these
/// are the whole texts, trimmed).
fn user_messages(request: &SummaryRequest) -> Vec<String> {
    request
        .entries
        .iter()
        .filter(|e| e.role == Role::User)
        .flat_map(|e| &e.parts)
        .filter_map(|p| match p {
            Part::Text { text } => Some(split_user_text(text).own_words),
            _ => None,
        })
        .filter(|words| !words.is_empty())
        .collect()
}

#[test]
fn every_user_message_appears_in_order_and_cut() {
    let config = ExtractiveConfig {
        max_message_chars: MAX_CHARS,
    };
    for path in fixtures() {
        let request = request(&path);
        let out = extract(&request, &config);
        let name = path.display();
        let section6 = out
            .split_once("6. All user messages:")
            .and_then(|(_, rest)| rest.split_once("7. Pending Tasks:"))
            .map(|(s, _)| normalized(s))
            .unwrap_or_else(|| panic!("{name}: no section 6\n{out}"));
        let messages = user_messages(&request);
        assert!(!messages.is_empty(), "{name}");
        let mut at = 0;
        for (i, message) in messages.iter().enumerate() {
            // Quoted verbatim (line breaks aside); a long one keeps its head and tail.
            let chars = message.chars().count();
            let quoted = if chars > MAX_CHARS {
                let head: String = message.chars().take(MAX_CHARS.div_ceil(2)).collect();
                let tail: String = message.chars().skip(chars - MAX_CHARS / 2).collect();
                let cut = chars - MAX_CHARS;
                format!("{}. {head} [… {cut} characters cut …] {tail}", i + 1)
            } else {
                format!("{}. {message}", i + 1)
            };
            let quoted = normalized(&quoted);
            let found = section6[at..]
                .find(&quoted)
                .unwrap_or_else(|| panic!("{name}: user message {} missing: {quoted}", i + 1));
            at += found + quoted.len();
        }
    }
}

#[test]
fn sections_files_focus_and_prior_summary_appear() {
    for path in fixtures() {
        let request = request(&path);
        let out = extract(&request, &ExtractiveConfig::default());
        let name = path.display();
        let mut at = 0;
        for heading in SECTIONS {
            let found = out[at..]
                .find(heading)
                .unwrap_or_else(|| panic!("{name}: `{heading}` missing or out of order\n{out}"));
            at += found + heading.len();
        }
        // compactor lists the files after the summary; the summary only counts them.
        let files = out
            .split_once("3. Files and Code Sections:")
            .and_then(|(_, rest)| rest.split_once("4. Errors and fixes:"))
            .map(|(s, _)| s)
            .expect("section 3");
        let count = |n: usize| match n {
            1 => "1 file".to_owned(),
            n => format!("{n} files"),
        };
        assert_eq!(
            files.trim(),
            format!(
                "- Read: {}, modified: {} (listed after this summary).",
                count(request.read_files.len()),
                count(request.modified_files.len())
            ),
            "{name}"
        );
        assert!(out.contains("keep the exact commands"), "{name}");
        assert!(out.contains("PRIOR: the user first asked to set up the repository."));
        assert!(out.contains("compaction #2"), "{name}");
    }
}

#[test]
fn tool_errors_and_the_latest_work_are_extracted() {
    let path = fixtures()
        .into_iter()
        .find(|p| p.ends_with("swe-agent-marshmallow-function-calling.json"))
        .expect("the marshmallow transcript is a fixture");
    let request = request(&path);
    let out = extract(&request, &ExtractiveConfig::default());
    let errors = out
        .split_once("4. Errors and fixes:")
        .and_then(|(_, rest)| rest.split_once("5. Problem Solving:"))
        .map(|(s, _)| s)
        .expect("section 4");
    assert!(
        errors.contains("[edit] Your proposed edit has introduced new syntax error(s)."),
        "{errors}"
    );
    let current = out
        .split_once("8. Current Work:")
        .and_then(|(_, rest)| rest.split_once("9. Optional Next Step:"))
        .map(|(s, _)| s)
        .expect("section 8");
    assert!(current.contains("Calling `submit` to submit."), "{current}");
    assert!(current.contains("Last tool call: submit({})"), "{current}");
    assert!(
        out.contains("Tools used: create ×1, edit ×3, bash ×4, find_file ×1, open ×1, submit ×1"),
        "{out}"
    );
}

#[tokio::test]
async fn output_is_deterministic() {
    let plugin = ExtractiveSummarizer::new(ExtractiveConfig::default());
    assert_eq!(plugin.name(), "extractive");
    for path in fixtures() {
        let request = request(&path);
        let a = plugin.summarize(&request).await.expect("summary").text;
        let b = plugin
            .summarize(&request.clone())
            .await
            .expect("summary")
            .text;
        assert_eq!(a, b, "{}", path.display());
        assert_eq!(a, extract(&request, &ExtractiveConfig::default()));
    }
}
