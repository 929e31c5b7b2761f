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
