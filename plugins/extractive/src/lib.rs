//! The `extractive` summarizer: local, deterministic, no network.
//!
//! It fills the same nine sections the compaction prompt asks an LLM for, straight from the
//! structured [`SummaryRequest`]:
//!
//! - **User messages are the person's own words.** Each text part of a user turn goes through
//!   [`split_user_text`]: what agents inject around the typed words (`<system-reminder>`
//!   blocks with CLAUDE.md, slash-command echoes, `<local-command-stdout>`, Codex's
//!   `<environment_context>`, a carried-over summary, `[Request interrupted by user]`) is left
//!   out. Section 6 lists every turn's own words verbatim, in order (line breaks kept,
//!   continuation lines indented); a turn longer than `max_message_chars` keeps its head and
//!   its tail around a `[… N characters cut …]` marker, so it is never dropped. Turns that hold
//!   only injected context are not listed; one line says how many there were.
//! - **Section 1** quotes the first turn with own words (pure-context turns and `[system] `
//!   entries are never the primary request), then lists the mid-conversation system messages
//!   (entries the engine renders as `[system] …`) verbatim under "System instructions", cut
//!   the same way as user turns; **section 7** quotes the latest own words.
//! - **Section 3** only counts the files read and modified: compactor appends both lists to
//!   the summary message itself, so they are not repeated.
//! - The tools used, the last error lines seen in tool outputs, the steps taken, the latest
//!   assistant text as the current work, the focus instructions of a manual compaction, and
//!   the prior summary carried forward under its own heading.
//!
//! The same request always yields the same text, so it is the offline default and the safe
//! last fallback.
#![deny(missing_docs)]

use std::fmt::Write as _;

use compactor_plugin_api::{
    is_blank, split_user_text, BoxFuture, Entry, Part, Role, SummarizeError, Summarizer, Summary,
    SummaryRequest,
};

/// Most error lines kept in section 4 (the latest ones).
const MAX_ERROR_LINES: usize = 8;
/// Longest error line kept.
const MAX_ERROR_LINE_CHARS: usize = 200;
/// Most tool calls listed in section 5 (the latest ones).
const MAX_STEPS: usize = 12;
/// Longest tool-call argument string shown in section 5.
const MAX_ARGUMENT_CHARS: usize = 120;
/// Phrases that mark a tool-output line as an error, matched in its lowercase form. Bare words
/// such as `error` are too common in code listings (`except MyError as error:`) to count alone.
const ERROR_MARKERS: [&str; 9] = [
    "error:",
    "error[",
    "error(s)",
    "exception:",
    "traceback (most recent call last)",
    "panicked at",
    " failed",
    "fatal:",
    "errors:",
];
/// Line prefixes (lowercase) that mark an error line on their own.
const ERROR_STARTS: [&str; 4] = ["error", "failed", "fatal", "failure"];
/// Masked tool outputs carry no information worth extracting.
const MASKED_PREFIX: &str = "[output masked";
/// The prior summary is never cut below this many characters, whatever the budget.
const MIN_PRIOR_CHARS: usize = 2_000;
/// Rough characters per token, to turn `max_output_tokens` into a character budget.
const CHARS_PER_TOKEN: usize = 4;
/// How the engine marks a mid-conversation system message it renders as a user entry.
const SYSTEM_PREFIX: &str = "[system] ";

/// Settings of the `extractive` backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtractiveConfig {
    /// Each quoted user message and system instruction longer than this keeps this many
    /// characters, its head and its tail, around a marker; the current work, the focus and
    /// tool arguments are cut to it (or less) at the end.
    pub max_message_chars: usize,
}

impl Default for ExtractiveConfig {
    fn default() -> Self {
        ExtractiveConfig {
            max_message_chars: 500,
        }
    }
}

/// The `extractive` backend.
#[derive(Debug, Clone, Default)]
pub struct ExtractiveSummarizer {
    config: ExtractiveConfig,
}

impl ExtractiveSummarizer {
    /// A backend with these settings.
    pub fn new(config: ExtractiveConfig) -> ExtractiveSummarizer {
        ExtractiveSummarizer { config }
    }
}

impl Summarizer for ExtractiveSummarizer {
    fn name(&self) -> &str {
        "extractive"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        let text = extract(request, &self.config);
        Box::pin(async move { Summary::new(text) })
    }
}

/// Writes the nine-section summary of `request`. Pure and deterministic.
pub fn extract(request: &SummaryRequest, config: &ExtractiveConfig) -> String {
    let max = config.max_message_chars.max(1);
    let turns: Vec<UserTurn> = request
        .entries
        .iter()
        .filter(|e| e.role == Role::User)
        .filter_map(user_turn)
        .collect();
    let own_words: Vec<&str> = turns
        .iter()
        .filter_map(|t| match t {
            UserTurn::OwnWords(w) => Some(w.as_str()),
            _ => None,
        })
        .collect();
    let system: Vec<&str> = turns
        .iter()
        .filter_map(|t| match t {
            UserTurn::System(s) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    let context_only = turns
        .iter()
        .filter(|t| matches!(t, UserTurn::ContextOnly))
        .count();
    let tool_calls: Vec<(&str, &str)> = request
        .entries
        .iter()
        .flat_map(|e| &e.parts)
        .filter_map(|p| match p {
            Part::ToolCall { name, arguments } => Some((name.as_str(), arguments.as_str())),
            _ => None,
        })
        .collect();
    let latest_assistant = request
        .entries
        .iter()
        .rev()
        .filter(|e| e.role == Role::Assistant)
        .find_map(entry_text);
    let focus = request
        .instructions
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty());

    let mut out = String::new();
    let _ = writeln!(
        out,
        "(Summary of compaction #{} extracted from the conversation without a language model; \
         the user's own words are quoted verbatim, without the context their agent injected, \
         and quotes longer than {max} characters are cut in the middle.)",
        request.compaction_num
    );
    if let Some(focus) = focus {
        let _ = writeln!(
            out,
            "Focus requested for this summary: {}",
            clip(focus, max)
        );
    }

    section(&mut out, 1, "Primary Request and Intent");
    match own_words.first() {
        Some(first) => quote(&mut out, "   - ", &cut_middle(first, max)),
        None => item(
            &mut out,
            "No message of the user's own in the summarised turns.",
        ),
    }
    if request.prior_summary.is_some() {
        item(
            &mut out,
            "Earlier requests are in the prior summary carried forward at the end.",
        );
    }
    if !system.is_empty() {
        item(
            &mut out,
            "System instructions given during the conversation (verbatim, in order):",
        );
        for instruction in &system {
            quote(&mut out, "     - ", &cut_middle(instruction, max));
        }
    }

    section(&mut out, 2, "Key Technical Concepts");
    let tools = tool_counts(&tool_calls);
    if tools.is_empty() {
        item(&mut out, "No tools were used in the summarised turns.");
    } else {
        let list: Vec<String> = tools.iter().map(|(n, c)| format!("{n} ×{c}")).collect();
        item(&mut out, &format!("Tools used: {}", list.join(", ")));
    }
    if let Some(model) = &request.model {
        item(&mut out, &format!("Model: {model}"));
    }

    section(&mut out, 3, "Files and Code Sections");
    item(
        &mut out,
        &file_counts(request.read_files.len(), request.modified_files.len()),
    );

    section(&mut out, 4, "Errors and fixes");
    let errors = error_lines(&request.entries);
    if errors.is_empty() {
        item(&mut out, "No errors seen in tool outputs.");
    }
    for line in &errors {
        item(&mut out, line);
    }

    section(&mut out, 5, "Problem Solving");
    if tool_calls.is_empty() {
        item(&mut out, "No tool calls in the summarised turns.");
    } else {
        let skipped = tool_calls.len().saturating_sub(MAX_STEPS);
        if skipped > 0 {
            item(
                &mut out,
                &format!("({skipped} earlier tool calls omitted; latest last)"),
            );
        }
        for (name, args) in &tool_calls[skipped..] {
            item(
                &mut out,
                &format!("{name}({})", clip(args, MAX_ARGUMENT_CHARS)),
            );
        }
    }

    section(&mut out, 6, "All user messages");
    if own_words.is_empty() {
        item(&mut out, "None in the summarised turns.");
    }
    for (i, words) in own_words.iter().enumerate() {
        quote(
            &mut out,
            &format!("   {}. ", i + 1),
            &cut_middle(words, max),
        );
    }
    if context_only > 0 {
        item(
            &mut out,
            &format!(
                "{context_only} more user turn{} held only context injected by the agent \
                 (system reminders, command echoes and output, an earlier summary) and {} not \
                 listed.",
                if context_only == 1 { "" } else { "s" },
                if context_only == 1 { "is" } else { "are" },
            ),
        );
    }

    section(&mut out, 7, "Pending Tasks");
    if let Some(focus) = focus {
        item(&mut out, &format!("Honour the focus: {}", clip(focus, max)));
    }
    match own_words.last() {
        Some(last) => quote(
            &mut out,
            "   - ",
            &format!(
                "Whatever remains of the latest user message (6.{}): {}",
                own_words.len(),
                cut_middle(last, max)
            ),
        ),
        None => item(&mut out, "None recorded."),
    }

    section(&mut out, 8, "Current Work");
    match &latest_assistant {
        Some(text) => item(&mut out, &clip(text, max)),
        None => item(&mut out, "No assistant text in the summarised turns."),
    }
    if let Some((name, args)) = tool_calls.last() {
        item(
            &mut out,
            &format!("Last tool call: {name}({})", clip(args, MAX_ARGUMENT_CHARS)),
        );
    }

    section(&mut out, 9, "Optional Next Step");
    let last_is_own_words = request.entries.last().is_some_and(|e| {
        e.role == Role::User && matches!(user_turn(e), Some(UserTurn::OwnWords(_)))
    });
    item(
        &mut out,
        if last_is_own_words {
            "Answer the latest user message."
        } else {
            "Continue the current work in line with the latest user message."
        },
    );

    if let Some(prior) = request
        .prior_summary
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let _ = writeln!(out, "\nPrior summary (carried forward):");
        let budget = (request.max_output_tokens as usize).saturating_mul(CHARS_PER_TOKEN);
        let room = if budget == 0 {
            usize::MAX
        } else {
            budget
                .saturating_sub(out.chars().count())
                .max(MIN_PRIOR_CHARS)
        };
        out.push_str(&cut(prior, room));
        out.push('\n');
    }
    out
}

/// What a user entry contributes to the summary.
#[derive(Debug, Clone, PartialEq, Eq)]
enum UserTurn {
    /// The person's own words: those of each text part, joined by a line break.
    OwnWords(String),
    /// A mid-conversation system message the engine rendered as `[system] …`, verbatim.
    System(String),
    /// Text that was all injected context.
    ContextOnly,
}

/// The user entry as the summary sees it, or `None` when it holds no text at all.
fn user_turn(entry: &Entry) -> Option<UserTurn> {
    let joined = entry_text(entry)?;
    if joined.starts_with(SYSTEM_PREFIX) {
        return Some(UserTurn::System(joined));
    }
    let mut words = String::new();
    for part in &entry.parts {
        let Part::Text { text } = part else { continue };
        let split = split_user_text(text);
        if split.own_words.is_empty() {
            continue;
        }
        if !words.is_empty() {
            words.push('\n');
        }
        words.push_str(&split.own_words);
    }
    Some(if words.is_empty() {
        UserTurn::ContextOnly
    } else {
        UserTurn::OwnWords(words)
    })
}

fn section(out: &mut String, n: u32, title: &str) {
    let _ = writeln!(out, "\n{n}. {title}:");
}

fn item(out: &mut String, text: &str) {
    let _ = writeln!(out, "   - {text}");
}

/// The one line of section 3: compactor lists the files after the summary text itself.
fn file_counts(read: usize, modified: usize) -> String {
    if read == 0 && modified == 0 {
        return "Read: none recorded, modified: none recorded.".to_owned();
    }
    let count = |n: usize| match n {
        0 => "none recorded".to_owned(),
        1 => "1 file".to_owned(),
        n => format!("{n} files"),
    };
    format!(
        "Read: {}, modified: {} (listed after this summary).",
        count(read),
        count(modified)
    )
}

/// Writes `text` after `lead`, line breaks kept: each further line is indented to the
/// column where the text started, blank lines stay empty.
fn quote(out: &mut String, lead: &str, text: &str) {
    let indent = lead.chars().count();
    out.push_str(lead);
    for (i, line) in text.lines().enumerate() {
        if i > 0 {
            out.push('\n');
            if !line.trim().is_empty() {
                out.extend(std::iter::repeat_n(' ', indent));
            }
        }
        out.push_str(if line.trim().is_empty() { "" } else { line });
    }
    out.push('\n');
}

/// The text parts of an entry joined, or `None` when it has no non-blank text.
fn entry_text(entry: &Entry) -> Option<String> {
    let texts: Vec<&str> = entry
        .parts
        .iter()
        .filter_map(|p| match p {
            Part::Text { text } => Some(text.trim()),
            _ => None,
        })
        .filter(|t| !is_blank(t))
        .collect();
    (!texts.is_empty()).then(|| texts.join("\n"))
}

/// Tool names with their call counts, in order of first use.
fn tool_counts<'a>(calls: &[(&'a str, &str)]) -> Vec<(&'a str, usize)> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for (name, _) in calls {
        match counts.iter_mut().find(|(n, _)| n == name) {
            Some((_, c)) => *c += 1,
            None => counts.push((name, 1)),
        }
    }
    counts
}

/// The latest distinct error lines of tool outputs, oldest first, each prefixed by its tool.
fn error_lines(entries: &[Entry]) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for part in entries.iter().flat_map(|e| &e.parts) {
        let Part::ToolResult {
            name,
            output,
            is_error,
        } = part
        else {
            continue;
        };
        if output.trim_start().starts_with(MASKED_PREFIX) {
            continue;
        }
        let mut found = false;
        for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if is_error_line(line) {
                push_unique(
                    &mut lines,
                    format!("[{name}] {}", clip(line, MAX_ERROR_LINE_CHARS)),
                );
                found = true;
            }
        }
        if *is_error && !found {
            if let Some(first) = output.lines().map(str::trim).find(|l| !l.is_empty()) {
                push_unique(
                    &mut lines,
                    format!("[{name}] {}", clip(first, MAX_ERROR_LINE_CHARS)),
                );
            }
        }
    }
    let skip = lines.len().saturating_sub(MAX_ERROR_LINES);
    lines.split_off(skip)
}

/// Whether a trimmed, non-empty tool-output line reports an error. Numbered source listings
/// (`12: code`, `12→code`, `12\tcode`, as file viewers print them) never do: they are code.
fn is_error_line(line: &str) -> bool {
    let after_number = line.trim_start_matches(|c: char| c.is_ascii_digit());
    if after_number.len() < line.len() && after_number.starts_with([':', '\u{2192}', '\t', '|']) {
        return false;
    }
    let lower = line.to_lowercase();
    ERROR_STARTS.iter().any(|s| lower.starts_with(s))
        || ERROR_MARKERS.iter().any(|m| lower.contains(m))
        || line.contains("FAILED")
}

fn push_unique(lines: &mut Vec<String>, line: String) {
    // Keep the latest occurrence so a repeated error counts as recent.
    lines.retain(|l| l != &line);
    lines.push(line);
}

/// `text` on one line (whitespace collapsed), cut to `max` characters with `…`.
pub fn clip(text: &str, max: usize) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    cut(&one_line, max)
}

/// `text` unchanged when it has at most `max` characters; otherwise its first `⌈max/2⌉` and
/// last `⌊max/2⌋` characters around a `[… N characters cut …]` marker.
fn cut_middle(text: &str, max: usize) -> String {
    let total = text.chars().count();
    if total <= max {
        return text.to_owned();
    }
    let head = max.div_ceil(2);
    let tail = max / 2;
    let boundary = |n: usize| text.char_indices().nth(n).map_or(text.len(), |(i, _)| i);
    format!(
        "{} [… {} characters cut …] {}",
        &text[..boundary(head)],
        total - head - tail,
        &text[boundary(total - tail)..]
    )
}

/// `text` cut to `max` characters with `…` when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use compactor_plugin_api::Caller;
    use std::time::Duration;

    fn text(role: Role, t: &str) -> Entry {
        Entry {
            role,
            parts: vec![Part::Text { text: t.into() }],
        }
    }

    fn request(entries: Vec<Entry>) -> SummaryRequest {
        SummaryRequest {
            prompt: String::new(),
            prior_summary: None,
            entries,
            read_files: vec![],
            modified_files: vec![],
            instructions: None,
            compaction_num: 1,
            model: None,
            max_output_tokens: 0,
            timeout: Duration::from_secs(1),
            caller: Caller::default(),
        }
    }

    #[test]
    fn error_lines_keep_the_latest_distinct_ones() {
        let mut parts = Vec::new();
        for i in 0..12 {
            parts.push(Part::ToolResult {
                name: "bash".into(),
                output: format!("ok\nError: number {i}\nmore"),
                is_error: false,
            });
        }
        parts.push(Part::ToolResult {
            name: "edit".into(),
            output: "no such file".into(),
            is_error: true,
        });
        parts.push(Part::ToolResult {
            name: "bash".into(),
            output: "[output masked for compaction] Error".into(),
            is_error: false,
        });
        let lines = error_lines(&[Entry {
            role: Role::Assistant,
            parts,
        }]);
        assert_eq!(lines.len(), MAX_ERROR_LINES);
        assert_eq!(
            lines.last().map(String::as_str),
            Some("[edit] no such file")
        );
        assert_eq!(lines[0], "[bash] Error: number 5");
    }

    #[test]
    fn focus_and_prior_summary_are_carried() {
        let mut r = request(vec![
            text(Role::User, "fix the parser"),
            text(Role::Assistant, "looking at parse.rs"),
        ]);
        r.instructions = Some("the API changes".into());
        r.prior_summary = Some("EARLIER: the user wanted a CLI".into());
        let s = extract(&r, &ExtractiveConfig::default());
        assert!(
            s.contains("Focus requested for this summary: the API changes"),
            "{s}"
        );
        assert!(s.contains("Prior summary (carried forward):\nEARLIER: the user wanted a CLI"));
        assert!(s.contains("   1. fix the parser"));
        assert!(s.contains("8. Current Work:\n   - looking at parse.rs"));
    }

    #[test]
    fn prior_summary_is_bounded_by_the_output_budget() {
        let mut r = request(vec![text(Role::User, "go")]);
        r.prior_summary = Some("p".repeat(100_000));
        r.max_output_tokens = 1_000;
        let s = extract(&r, &ExtractiveConfig::default());
        assert!(s.chars().count() < 4_000 + 10, "{}", s.len());
    }

    #[test]
    fn error_lines_are_told_from_code() {
        for yes in [
            "SyntaxError: invalid syntax",
            "error[E0308]: mismatched types",
            "Traceback (most recent call last):",
            "- E999 IndentationError: unexpected indent",
            "Your proposed edit has introduced new syntax error(s).",
            "FAILED tests/test_x.py::test_y - AssertionError",
            "fatal: not a git repository",
            "thread 'main' panicked at src/main.rs:3:5:",
            "Build failed with 2 errors",
            "Error: ENOENT",
        ] {
            assert!(is_error_line(yes), "{yes}");
        }
        for no in [
            "1522:        except FieldInstanceResolutionError as error:",
            "12\u{2192}    raise ValueError(\"x\")  # error: no",
            "7\terror: in a listing",
            "default_error_messages = {}",
            "All 12 tests passed",
        ] {
            assert!(!is_error_line(no), "{no}");
        }
    }

    #[test]
    fn cut_middle_keeps_head_and_tail() {
        assert_eq!(cut_middle("abcdef", 6), "abcdef");
        assert_eq!(cut_middle("abcdefg", 4), "ab [… 3 characters cut …] fg");
        assert_eq!(cut_middle("abcdefg", 3), "ab [… 4 characters cut …] g");
        assert_eq!(cut_middle("abc", 1), "a [… 2 characters cut …] ");
        assert_eq!(
            cut_middle("日本語のテキスト", 4),
            "日本 [… 4 characters cut …] スト"
        );
    }

    #[test]
    fn user_turns_are_own_words_system_or_context() {
        let turn = |blocks: &[&str]| {
            user_turn(&Entry {
                role: Role::User,
                parts: blocks
                    .iter()
                    .map(|t| Part::Text {
                        text: (*t).to_owned(),
                    })
                    .collect(),
            })
        };
        assert_eq!(
            turn(&[
                "<system-reminder>x</system-reminder>",
                "fix it",
                "and test it"
            ]),
            Some(UserTurn::OwnWords("fix it\nand test it".into()))
        );
        assert_eq!(
            turn(&[
                "<command-name>/cost</command-name>",
                "[Request interrupted by user]"
            ]),
            Some(UserTurn::ContextOnly)
        );
        assert_eq!(
            turn(&["[system] <system-reminder>keep</system-reminder>"]),
            Some(UserTurn::System(
                "[system] <system-reminder>keep</system-reminder>".into()
            ))
        );
        assert_eq!(turn(&["  ", "\u{200B}"]), None);
        assert_eq!(turn(&[]), None);
    }

    #[test]
    fn quotes_keep_lines_under_their_lead() {
        let mut out = String::new();
        quote(&mut out, "   2. ", "one\n\n  two\r\n \nthree");
        assert_eq!(out, "   2. one\n\n        two\n\n      three\n");
    }

    #[test]
    fn clip_collapses_whitespace_and_cuts() {
        assert_eq!(clip("a\n\n b  c", 100), "a b c");
        assert_eq!(clip("abcdef", 3), "abc…");
    }
}
