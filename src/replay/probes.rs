//! What a compaction forgot, measured: deterministic probes built from the messages of the
//! request as received, checked against the request forwarded (`compactor replay`).
//!
//! A probe is a short piece of text a later turn may need, in one of five [`Category`]s:
//! - `task`: the task statement, the first user message after the system prompt (its own
//!   words, injected context such as `<system-reminder>` blocks left out);
//! - `user_words`: every later user message's own words ([`split_user_text`]); tool results and
//!   SWE-agent observations sent as user turns (`compaction.observation_pattern`) are not
//!   anyone's words. Both take three of a message's lines of at least [`MIN_SPAN`] characters
//!   (whitespace collapsed), the first, the middle one and the last, each cut to its first
//!   [`MAX_SPAN`] characters (the whole text, cut the same way, when no line is that long);
//! - `files`: the files the assistant's tool calls and SWE-agent commands read or modified, as
//!   the compactor's own file tracking reads them ([`FileTracker`]);
//! - `errors`: the error lines of tool outputs (`Traceback`, `SomethingError: …` outside code,
//!   `error:`,
//!   `fatal:`, pytest's `E   …`, `FAILED`, `command not found`, `No such file or directory`,
//!   a nonzero exit code, `panicked at`), at most [`ERRORS_PER_OUTPUT`] per output;
//! - `identifiers`: the function and class names the assistant wrote in its tool calls'
//!   arguments and in fenced code blocks (`def name`, `class Name`, `fn name`, `func name`,
//!   `function name`).
//!
//! The rule ([`Prober::score`]): at each request whose forwarded body differs from the one
//! received, a message of the received request is *touched* when its raw JSON is not among the
//! forwarded request's messages byte for byte (summarised away, masked, or merged with the
//! summary). Every distinct probe of the touched messages is counted once for that request,
//! and is *kept* when its text appears in the forwarded request's messages (the summary and
//! every message kept), compared with JSON strings decoded and whitespace collapsed. Requests
//! forwarded as received touch nothing and count nothing. A probe lost by a compaction is
//! counted again at every later request that does without it: the shares are over
//! (request, probe) pairs. Probes are extracted once per distinct message, so a long
//! recording is not rescanned at every step.

use std::collections::{HashMap, HashSet};

use compactor_plugin_api::split_user_text;
use regex::Regex;
use serde_json::Value;

use crate::compaction::files::FileTracker;
use crate::dialect::DialectKind;
use crate::estimate::LazyEstimator;
use crate::transcript::{Message, Part, Role, Transcript};

/// Shortest line (in characters, whitespace collapsed) that is a probe of a user message.
pub const MIN_SPAN: usize = 20;

/// Characters of a line kept in its probe.
pub const MAX_SPAN: usize = 80;

/// Characters of an error line kept in its probe.
const MAX_ERROR: usize = 120;

/// Error lines taken from one tool output.
pub const ERRORS_PER_OUTPUT: usize = 5;

/// Shortest identifier that is a probe (`fn f` says little).
const MIN_IDENTIFIER: usize = 3;

/// What a probe stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    /// The task statement: the first user message.
    Task,
    /// Every later user message's own words.
    UserWords,
    /// Files read or modified.
    Files,
    /// Error lines of tool outputs.
    Errors,
    /// Function and class names in the assistant's edits.
    Identifiers,
}

impl Category {
    /// Every category, in table order.
    pub const ALL: [Category; 5] = [
        Category::Task,
        Category::UserWords,
        Category::Files,
        Category::Errors,
        Category::Identifiers,
    ];

    /// Its name in the table and the JSON.
    pub fn label(self) -> &'static str {
        match self {
            Category::Task => "task",
            Category::UserWords => "user_words",
            Category::Files => "files",
            Category::Errors => "errors",
            Category::Identifiers => "identifiers",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Probes kept of probes counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Probes whose text was in the forwarded request.
    pub kept: usize,
    /// Probes counted.
    pub total: usize,
}

impl Tally {
    /// `kept/total (share%)`, or `-` when nothing was counted.
    pub fn cell(&self) -> String {
        if self.total == 0 {
            "-".into()
        } else {
            format!(
                "{}/{} ({:.0}%)",
                self.kept,
                self.total,
                100.0 * self.kept as f64 / self.total as f64
            )
        }
    }
}

/// Kept and counted probes per category, over the requests of a replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeScore {
    tallies: [Tally; 5],
}

impl ProbeScore {
    /// The tally of `category`.
    pub fn get(&self, category: Category) -> Tally {
        self.tallies[category.index()]
    }

    /// Every category together.
    pub fn all(&self) -> Tally {
        self.tallies.iter().fold(Tally::default(), |acc, t| Tally {
            kept: acc.kept + t.kept,
            total: acc.total + t.total,
        })
    }

    /// Counts one probe.
    pub fn count(&mut self, category: Category, kept: bool) {
        let t = &mut self.tallies[category.index()];
        t.total += 1;
        t.kept += usize::from(kept);
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &ProbeScore) {
        for (t, o) in self.tallies.iter_mut().zip(other.tallies) {
            t.kept += o.kept;
            t.total += o.total;
        }
    }
}

/// How a message of the received request is read for probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The first user message.
    Task,
    /// A later user message (tool results it carries are outputs).
    User,
    /// A tool output: a tool message, or an observation sent as a user turn.
    Output,
    /// The model's message.
    Assistant,
    /// A system or developer message: never probed.
    System,
}

/// The kind of every message of `transcript`: the first user message that answers no tool
/// call is the task; a user message of text only that follows the assistant's and matches
/// `observations` is an output.
pub fn kinds(transcript: &Transcript, observations: Option<&Regex>) -> Vec<Kind> {
    let mut task_seen = false;
    let messages = &transcript.messages;
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| match m.role {
            Role::System => Kind::System,
            Role::Assistant => Kind::Assistant,
            Role::Tool => Kind::Output,
            Role::User if m.is_tool_answer() => Kind::User,
            Role::User if !task_seen => {
                task_seen = true;
                Kind::Task
            }
            Role::User => {
                let after_assistant = i > 0 && messages[i - 1].role == Role::Assistant;
                let text_only = m.parts.iter().all(|p| matches!(p, Part::Text(_)));
                let observed = observations.is_some_and(|pattern| pattern.is_match(&m.text()));
                if after_assistant && text_only && observed {
                    Kind::Output
                } else {
                    Kind::User
                }
            }
        })
        .collect()
}

/// The probes of one message read as `kind`, in order, repeats included.
pub fn probes_of(message: &Message, kind: Kind) -> Vec<(Category, String)> {
    let mut out = Vec::new();
    for part in &message.parts {
        match (part, kind) {
            (Part::ToolResult(result), _) => {
                let text: Vec<&str> = result
                    .content
                    .iter()
                    .filter_map(|p| match p {
                        Part::Text(t) => Some(t.as_str()),
                        _ => None,
                    })
                    .collect();
                push_errors(&mut out, &text.join("\n"));
            }
            (Part::Text(text), Kind::Task | Kind::User) => {
                let category = if kind == Kind::Task {
                    Category::Task
                } else {
                    Category::UserWords
                };
                let words = split_user_text(text).own_words;
                out.extend(spans(&words).into_iter().map(|s| (category, s)));
            }
            (Part::Text(text), Kind::Output) => push_errors(&mut out, text),
            (Part::Text(text), Kind::Assistant) => {
                for block in fenced_blocks(text) {
                    push_identifiers(&mut out, block);
                }
            }
            (Part::ToolCall(call), Kind::Assistant) => {
                for value in argument_strings(&call.arguments) {
                    push_identifiers(&mut out, &value);
                }
            }
            _ => {}
        }
    }
    if kind == Kind::Assistant {
        let mut tracker = FileTracker::with_limit(usize::MAX);
        tracker.observe_message(message);
        for file in tracker.read_files().iter().chain(tracker.modified_files()) {
            let file = normalise(file);
            if !file.is_empty() {
                out.push((Category::Files, file));
            }
        }
    }
    out
}

/// Scores requests against what was forwarded, remembering each message's probes.
#[derive(Debug, Default)]
pub struct Prober {
    observations: Option<Regex>,
    /// Probes by (raw message JSON, kind).
    cache: HashMap<(String, Kind), Vec<(Category, String)>>,
}

impl Prober {
    /// A prober telling observations sent as user turns by `observations`
    /// (`compaction.observation_pattern`).
    pub fn new(observations: Option<Regex>) -> Prober {
        Prober {
            observations,
            cache: HashMap::new(),
        }
    }

    /// The probes of the touched messages of one request received as `received` and forwarded
    /// as `forwarded`, counted once each (see the module's rule). Nothing when the bodies are
    /// the same, or when either cannot be read in `dialect`.
    pub fn score(&mut self, dialect: DialectKind, received: &[u8], forwarded: &[u8]) -> ProbeScore {
        let mut score = ProbeScore::default();
        if received == forwarded {
            return score;
        }
        let estimator = LazyEstimator::default();
        let (Ok(before), Ok(after)) = (
            dialect.scan(received, &estimator),
            dialect.scan(forwarded, &estimator),
        ) else {
            return score;
        };
        let (Ok(transcript), Ok(sent)) = (before.transcript(0), after.transcript(0)) else {
            return score;
        };
        let verbatim: HashSet<&str> = after.messages.iter().copied().collect();
        let kinds = kinds(&transcript, self.observations.as_ref());
        let mut touched: Vec<(Category, String)> = Vec::new();
        for ((raw, message), kind) in before.messages.iter().zip(&transcript.messages).zip(kinds) {
            if kind == Kind::System || verbatim.contains(raw) {
                continue;
            }
            let probes = self
                .cache
                .entry(((*raw).to_string(), kind))
                .or_insert_with(|| probes_of(message, kind));
            touched.extend(probes.iter().cloned());
        }
        if touched.is_empty() {
            return score;
        }
        let haystack = haystack(&sent);
        let mut seen = HashSet::new();
        for (category, text) in &touched {
            if seen.insert((*category, text.as_str())) {
                score.count(*category, haystack.contains(text.as_str()));
            }
        }
        score
    }
}

/// Everything the model reads of `transcript`'s messages, each message's text with JSON
/// strings decoded and whitespace collapsed, one message per line.
pub fn haystack(transcript: &Transcript) -> String {
    let mut out = String::new();
    for message in &transcript.messages {
        let mut texts: Vec<String> = Vec::new();
        collect_texts(&message.parts, &mut texts);
        out.push_str(&normalise(&texts.join("\n")));
        out.push('\n');
    }
    out
}

fn collect_texts(parts: &[Part], out: &mut Vec<String>) {
    for part in parts {
        match part {
            Part::Text(t) | Part::Reasoning(t) => out.push(t.clone()),
            Part::ToolCall(call) => {
                out.push(call.name.clone());
                out.extend(argument_strings(&call.arguments));
            }
            Part::ToolResult(result) => collect_texts(&result.content, out),
            _ => {}
        }
    }
}

/// Whitespace collapsed to single spaces, ends trimmed.
pub fn normalise(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The first `max` characters of `text`.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => text[..at].trim_end().to_string(),
        None => text.to_string(),
    }
}

/// The probes of a user message's own words (see the module doc).
fn spans(words: &str) -> Vec<String> {
    let lines: Vec<String> = words
        .lines()
        .map(normalise)
        .filter(|l| l.chars().count() >= MIN_SPAN)
        .collect();
    if lines.is_empty() {
        let whole = normalise(words);
        return if whole.chars().count() >= MIN_SPAN {
            vec![cut(&whole, MAX_SPAN)]
        } else {
            Vec::new()
        };
    }
    let last = lines.len() - 1;
    let mut picked = vec![0, last / 2, last];
    picked.dedup();
    picked.iter().map(|&i| cut(&lines[i], MAX_SPAN)).collect()
}

/// The string values of a tool call's arguments (the arguments themselves when they are not
/// JSON).
fn argument_strings(arguments: &str) -> Vec<String> {
    fn walk(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::String(s) => out.push(s.clone()),
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            Value::Object(map) => map.values().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(value) => {
            let mut out = Vec::new();
            walk(&value, &mut out);
            out
        }
        Err(_) => vec![arguments.to_string()],
    }
}

/// The bodies of the fenced code blocks of `text` (fences at the start of their lines).
fn fenced_blocks(text: &str) -> Vec<&str> {
    let mut blocks = Vec::new();
    let mut open: Option<usize> = None;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            match open.take() {
                Some(start) => blocks.push(&text[start..at]),
                None => open = Some(at + line.len()),
            }
        }
        at += line.len();
    }
    blocks
}

/// Whether `line` is an error line of a command's output (see the module doc).
pub fn is_error_line(line: &str) -> bool {
    let trimmed = line.trim();
    if trimmed.starts_with("Traceback (most recent call last)") {
        return true;
    }
    // `ValueError: ...`, `E999 IndentationError: ...`, `AssertionError` alone; not a line of
    // code (`except ValueError:`) nor a numbered line of a file listing (`12:    raise ...`).
    let numbered = trimmed
        .split_once(':')
        .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    let mut previous = "";
    for token in trimmed.split_whitespace() {
        let name = token.strip_suffix(':').unwrap_or(token);
        let named = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            && (name.ends_with("Error") || name.ends_with("Exception"));
        let stated = token.ends_with(':') || trimmed == token;
        if named && stated && !numbered && !matches!(previous, "except" | "raise" | "catch") {
            return true;
        }
        previous = token;
    }
    let lower = trimmed.to_ascii_lowercase();
    if ["error:", "error[", "fatal:"]
        .iter()
        .any(|p| lower.starts_with(p))
    {
        return true;
    }
    // pytest's failure detail lines.
    if line.starts_with("E   ") && trimmed.len() > 1 {
        return true;
    }
    if [
        "FAILED",
        "command not found",
        "No such file or directory",
        "panicked at",
        "Segmentation fault",
    ]
    .iter()
    .any(|s| trimmed.contains(s))
    {
        return true;
    }
    ["exit code ", "exit status ", "exited with code "]
        .iter()
        .any(|p| {
            lower.match_indices(p).any(|(at, _)| {
                lower[at + p.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_digit() && c != '0')
            })
        })
}

fn push_errors(out: &mut Vec<(Category, String)>, text: &str) {
    let lines = text
        .lines()
        .filter(|l| is_error_line(l))
        .map(|l| cut(&normalise(l), MAX_ERROR))
        .take(ERRORS_PER_OUTPUT);
    out.extend(lines.map(|l| (Category::Errors, l)));
}

/// The names after `def`, `class`, `fn`, `func` and `function` in `code`.
pub fn identifiers(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for keyword in ["def", "class", "fn", "func", "function"] {
        for (at, _) in code.match_indices(keyword) {
            let starts_word = code[..at]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
            let rest = &code[at + keyword.len()..];
            let name_at = rest.len() - rest.trim_start_matches([' ', '\t']).len();
            if !starts_word || name_at == 0 {
                continue;
            }
            let name: String = rest[name_at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let valid = name
                .chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_');
            if valid && name.chars().count() >= MIN_IDENTIFIER {
                out.push(name);
            }
        }
    }
    out
}

fn push_identifiers(out: &mut Vec<(Category, String)>, code: &str) {
    out.extend(
        identifiers(code)
            .into_iter()
            .map(|name| (Category::Identifiers, name)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const TASK: &str = "Fix the flaky date parser in the billing module before Friday";
    const ASK: &str = "Keep the public signature of parse_invoice_date exactly as it is";
    const PATH: &str = "src/billing/dates.py";
    const ERROR: &str = "ValueError: month must be in 1..12, got 13";
    const BURIED: &str = "buried_helper_function";

    fn call(id: &str, name: &str, arguments: Value) -> Value {
        json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": arguments.to_string()}})
    }

    /// A Chat Completions conversation holding one probe of each category in its first
    /// turns, then `filler` turns of reading other files.
    fn conversation(filler: usize) -> Vec<Value> {
        // The edit defines its function after 600 characters of comment: a summary that
        // quotes the call's start does not reach it.
        let edit = format!(
            "# {}\ndef {BURIED}(value):\n    return value\n",
            "x".repeat(600)
        );
        let mut messages = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": TASK}),
            json!({"role": "assistant", "content": "Reading it.",
                "tool_calls": [call("c1", "bash", json!({"command": format!("cat {PATH}")}))]}),
            json!({"role": "tool", "tool_call_id": "c1", "content":
                format!("Traceback (most recent call last):\n  File \"{PATH}\", line 3\n{ERROR}\n")}),
            json!({"role": "assistant", "content": "Found it."}),
            json!({"role": "user", "content": ASK}),
            json!({"role": "assistant", "content": "Editing.", "tool_calls": [call(
                "c2", "str_replace_editor",
                json!({"command": "str_replace", "path": PATH, "old_str": "x", "new_str": edit}))]}),
            json!({"role": "tool", "tool_call_id": "c2", "content": "File updated."}),
        ];
        for i in 0..filler {
            let id = format!("f{i}");
            messages.push(json!({"role": "assistant", "content": format!("Looking at file {i}."),
                "tool_calls": [call(&id, "bash", json!({"command": format!("cat docs/notes_{i}.md")}))]}));
            messages.push(json!({"role": "tool", "tool_call_id": id,
                "content": format!("notes {i}: {}", "lorem ipsum ".repeat(150))}));
        }
        messages.push(
            json!({"role": "user", "content": "Now run the whole test suite once more please"}),
        );
        messages
    }

    fn body(messages: &[Value]) -> Vec<u8> {
        json!({"model": "gpt-4o", "messages": messages})
            .to_string()
            .into_bytes()
    }

    fn tally(score: &ProbeScore, category: Category) -> (usize, usize) {
        let t = score.get(category);
        (t.kept, t.total)
    }

    #[test]
    fn touched_probes_are_kept_only_when_their_text_is_forwarded() {
        let received = conversation(0);
        // The summary names the task and the file; it leaves out the user's request, the
        // error line and the identifier. The last two messages and the system prompt go as
        // received, so their probes are not counted.
        let summary = format!("Summary: the user asked: {TASK}. The agent read {PATH}.");
        let mut forwarded = vec![
            received[0].clone(),
            json!({"role": "user", "content": summary}),
        ];
        forwarded.extend(received[received.len() - 2..].iter().cloned());
        let mut prober = Prober::new(None);
        let score = prober.score(
            DialectKind::ChatCompletions,
            &body(&received),
            &body(&forwarded),
        );
        assert_eq!(tally(&score, Category::Task), (1, 1));
        assert_eq!(
            tally(&score, Category::Files),
            (1, 1),
            "{PATH} counted once"
        );
        assert_eq!(tally(&score, Category::UserWords), (0, 1));
        // `Traceback (most recent call last):` and the ValueError line, both lost.
        assert_eq!(tally(&score, Category::Errors), (0, 2));
        assert_eq!(tally(&score, Category::Identifiers), (0, 1));
        assert_eq!(score.all(), Tally { kept: 2, total: 6 });

        // Forwarded as received: nothing touched, nothing counted.
        let same = prober.score(
            DialectKind::ChatCompletions,
            &body(&received),
            &body(&received),
        );
        assert_eq!(same.all(), Tally::default());
    }

    #[test]
    fn probes_read_anthropic_messages_and_responses_bodies_alike() {
        // The same hand compaction in Claude Code's and Codex's shapes: the task, a file read
        // and its error summarised; the summary names the file only.
        let summary = format!("Summary: the agent read {PATH}.");
        let output = format!("Traceback (most recent call last):\n{ERROR}\n");
        let read = json!({"command": format!("cat {PATH}")});
        let messages = |summarised: bool| -> Vec<u8> {
            let mut m = if summarised {
                vec![json!({"role": "user", "content": [{"type": "text", "text": summary}]})]
            } else {
                vec![
                    json!({"role": "user", "content": [{"type": "text", "text": TASK}]}),
                    json!({"role": "assistant", "content": [
                        {"type": "tool_use", "id": "t1", "name": "bash", "input": read}]}),
                    json!({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": output}]}),
                ]
            };
            m.push(json!({"role": "assistant", "content": [{"type": "text", "text": "Done."}]}));
            m.push(json!({"role": "user", "content": [{"type": "text", "text": "Thanks, and the tests?"}]}));
            json!({"model": "claude-test", "max_tokens": 100, "system": "You are a coding agent.",
                "messages": m})
            .to_string()
            .into_bytes()
        };
        let responses = |summarised: bool| -> Vec<u8> {
            let mut input = if summarised {
                vec![json!({"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": summary}]})]
            } else {
                vec![
                    json!({"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": TASK}]}),
                    json!({"type": "function_call", "call_id": "c1", "name": "shell",
                        "arguments": read.to_string()}),
                    json!({"type": "function_call_output", "call_id": "c1", "output": output}),
                ]
            };
            input.push(json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Done."}]}));
            input.push(json!({"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Thanks, and the tests?"}]}));
            json!({"model": "gpt-test", "instructions": "You are a coding agent.", "input": input})
                .to_string()
                .into_bytes()
        };
        for (dialect, shape) in [
            (DialectKind::Messages, &messages as &dyn Fn(bool) -> Vec<u8>),
            (DialectKind::Responses, &responses),
        ] {
            let score = Prober::new(None).score(dialect, &shape(false), &shape(true));
            let label = dialect.label();
            assert_eq!(tally(&score, Category::Task), (0, 1), "{label}");
            assert_eq!(tally(&score, Category::Files), (1, 1), "{label}");
            assert_eq!(tally(&score, Category::Errors), (0, 2), "{label}");
        }
    }

    #[tokio::test]
    async fn an_extractive_compaction_keeps_what_it_quotes_and_loses_the_buried_identifier() {
        let config = crate::config::Config::from_toml(
            "[summarizer]\nbackend = \"extractive\"\n[compaction]\nmax_messages = 10\n\
             min_preserve_tokens = 50\nmax_preserve_tokens = 400\n",
        )
        .expect("config");
        let received = body(&conversation(8));
        let report =
            crate::compact_once::compact(&config, DialectKind::ChatCompletions, None, &received)
                .await
                .expect("compacts");
        assert_ne!(report.forward, received, "{}", report.notes);
        let score =
            Prober::new(None).score(DialectKind::ChatCompletions, &received, &report.forward);
        let forwarded = String::from_utf8_lossy(&report.forward);
        // The opening (the task) is kept in the head: never touched, never counted.
        assert_eq!(tally(&score, Category::Task), (0, 0), "{forwarded}");
        // The extractive summary quotes every user message and lists the files touched.
        assert_eq!(tally(&score, Category::UserWords), (1, 1), "{forwarded}");
        // The path of the bug and the notes of the seven summarised turns (the eighth is kept
        // verbatim), each counted once.
        assert_eq!(tally(&score, Category::Files), (8, 8), "{forwarded}");
        // It quotes a call's arguments only so far: the function defined after 600
        // characters is not in the forwarded request, and counts as lost.
        assert!(!forwarded.contains(BURIED));
        assert_eq!(tally(&score, Category::Identifiers), (0, 1), "{forwarded}");
        // Both error lines of the summarised output are counted, kept as far as they are
        // in the forwarded body.
        let present = ["Traceback (most recent call last):", ERROR]
            .iter()
            .filter(|line| forwarded.contains(*line))
            .count();
        assert_eq!(tally(&score, Category::Errors), (present, 2), "{forwarded}");
    }

    #[test]
    fn observations_are_outputs_and_the_first_user_message_is_the_task() {
        let pattern = crate::config::Config::from_toml(
            "[compaction]\nobservation_pattern = 'bash-\\$\\s*$'\n",
        )
        .expect("config")
        .compaction
        .observation_regex()
        .expect("pattern");
        let transcript = Transcript::new(vec![
            Message::new(Role::System, vec![Part::Text("sys".into())]),
            Message::new(Role::User, vec![Part::Text(format!("{TASK}\nbash-$"))]),
            Message::new(Role::Assistant, vec![Part::Text("```\nls\n```".into())]),
            Message::new(
                Role::User,
                vec![Part::Text(format!(
                    "{ERROR}\n(Current directory: /x)\nbash-$"
                ))],
            ),
            Message::new(Role::Assistant, vec![Part::Text("done".into())]),
            Message::new(Role::User, vec![Part::Text(ASK.into())]),
        ]);
        let kinds = kinds(&transcript, pattern.as_ref());
        assert_eq!(
            kinds,
            [
                Kind::System,
                Kind::Task,
                Kind::Assistant,
                Kind::Output,
                Kind::Assistant,
                Kind::User
            ]
        );
        assert_eq!(
            probes_of(&transcript.messages[3], kinds[3]),
            [(Category::Errors, ERROR.to_string())]
        );
        // Without a pattern, the observation is the person's words.
        assert_eq!(super::kinds(&transcript, None)[3], Kind::User);
    }

    #[test]
    fn error_lines_identifiers_and_spans_follow_their_rules() {
        for line in [
            "Traceback (most recent call last):",
            "KeyError: 'x'",
            "- E999 IndentationError: unexpected indent",
            "error[E0425]: cannot find value `x`",
            "FAILED tests/test_a.py::test_b - assert 1 == 2",
            "bash: foo: command not found",
            "Process exited with code 2",
            "E       assert 1 == 2",
        ] {
            assert!(is_error_line(line), "{line}");
        }
        for line in [
            "    except ValueError:",
            "1474:        raise ValueError(\"bad\")",
            "12: except KeyError:",
            "0 errors, exit code 0",
            "Everything is fine",
        ] {
            assert!(!is_error_line(line), "{line}");
        }
        assert_eq!(
            identifiers("class Parser:\n    def parse_month(self):\n fn go() {}\nundef x\n"),
            ["parse_month", "Parser"]
        );
        let text = "first line of the request, long enough\nshort\nthe middle line, also long enough\nlast line of the request, long enough";
        assert_eq!(
            spans(text),
            [
                "first line of the request, long enough",
                "the middle line, also long enough",
                "last line of the request, long enough"
            ]
        );
        assert_eq!(spans("too short"), Vec::<String>::new());
        assert_eq!(
            spans(&"word ".repeat(40))
                .first()
                .map(|s| s.chars().count()),
            Some(79)
        );
    }

    /// Every probe of a recorded conversation is found in that conversation: a probe counts
    /// as lost only when what carried it is gone.
    #[test]
    fn every_probe_of_the_repository_transcripts_is_in_its_own_transcript() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transcripts");
        let pattern = crate::config::Config::from_toml(
            &std::fs::read_to_string(dir.join("strategies.toml")).expect("config"),
        )
        .expect("config")
        .compaction
        .observation_regex()
        .expect("pattern");
        let mut counted = 0;
        for entry in std::fs::read_dir(&dir).expect("transcripts") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let recording = crate::replay::load(&path).expect("loads");
            let Some(step) = recording.steps.last() else {
                continue;
            };
            let estimator = LazyEstimator::default();
            let scan = step.dialect.scan(&step.body, &estimator).expect("scans");
            let transcript = scan.transcript(0).expect("reads");
            let haystack = haystack(&transcript);
            let kinds = kinds(&transcript, pattern.as_ref());
            for (message, kind) in transcript.messages.iter().zip(kinds) {
                for (category, text) in probes_of(message, kind) {
                    assert!(
                        haystack.contains(&text),
                        "{}: {category:?} {text:?}",
                        path.display()
                    );
                    counted += 1;
                }
            }
        }
        assert!(counted >= 20, "{counted}");
    }
}
