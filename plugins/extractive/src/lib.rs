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
//!   assistant text as the current work, and the focus instructions of a manual compaction.
//! - **One updated summary, not a nest.** A prior summary of this backend's own is merged
//!   into the new one (see `carry`): its user messages and system instructions are listed
//!   again first, its tool counts added to this slice's, its error lines and steps come before
//!   this slice's under the same caps, and its current work stands when this slice has none.
//!   So the summary stays about the same size however many compactions a session has (what
//!   the compaction prompt asks an LLM for: "merge it with them into one updated summary"),
//!   instead of growing by a nested copy each time. A prior written by another backend (an
//!   LLM's) holds the only copy of what it summarised: it is carried forward under its own
//!   heading, and carried on by every later merge.
//!
//! The same request always yields the same text, so it is the offline default and the safe
//! last fallback.
#![deny(missing_docs)]

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use compactor_plugin_api::{
    is_blank, split_user_text, BoxFuture, Entry, InvalidSetting, Part, Role, SummarizeError,
    Summarizer, Summary, SummaryRequest,
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
/// A prior summary from another backend is never cut below this many characters, whatever
/// the budget: it holds the only copy of the earlier requests.
const MIN_PRIOR_CHARS: usize = 2_000;
/// Rough characters per token, to turn `max_output_tokens` into a character budget.
const CHARS_PER_TOKEN: usize = 4;
/// How the engine marks a mid-conversation system message it renders as a user entry.
const SYSTEM_PREFIX: &str = "[system] ";

/// Settings of the `extractive` backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExtractiveConfig {
    /// Each quoted user message and system instruction longer than this keeps this many
    /// characters, its head and its tail, around a marker; the current work, the focus and
    /// tool arguments are cut to it (or less) at the end.
    pub max_message_chars: usize,
}

impl ExtractiveConfig {
    /// Whether the settings can make a backend (`[summarizer.extractive]` of compactor's
    /// configuration file is this struct).
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.max_message_chars == 0 {
            return Err(InvalidSetting::new("max_message_chars", "must be positive"));
        }
        Ok(())
    }
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
    let prior = request
        .prior_summary
        .as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty());
    let carried = prior.map(carry).unwrap_or_default();
    let turns: Vec<UserTurn> = request
        .entries
        .iter()
        .filter(|e| e.role == Role::User)
        .filter_map(user_turn)
        .collect();
    // Both lists are cumulative: what an earlier summary listed (already cut), then this
    // slice's, cut once here.
    let mut own_words: Vec<String> = carried.user;
    let mut system: Vec<String> = carried.system;
    for turn in &turns {
        match turn {
            UserTurn::OwnWords(w) => own_words.push(cut_middle(w, max)),
            UserTurn::System(s) => system.push(cut_middle(s, max)),
            UserTurn::ContextOnly => {}
        }
    }
    let budget = (request.max_output_tokens as usize).saturating_mul(CHARS_PER_TOKEN);
    if budget > 0 {
        fit_lists(&mut own_words, &mut system, max, budget / 2);
    }
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
    let tools = merged_tool_counts(carried.tools, &tool_calls);
    let mut errors = carried.errors;
    for line in error_lines(&request.entries) {
        push_unique(&mut errors, line);
    }
    let errors = keep_last(errors, MAX_ERROR_LINES);
    let mut steps = carried.steps;
    steps.extend(
        tool_calls
            .iter()
            .map(|(name, args)| format!("{name}({})", clip(args, MAX_ARGUMENT_CHARS))),
    );
    let omitted = carried.omitted_steps + steps.len().saturating_sub(MAX_STEPS);
    let steps = keep_last(steps, MAX_STEPS);
    let latest_assistant = request
        .entries
        .iter()
        .rev()
        .filter(|e| e.role == Role::Assistant)
        .find_map(entry_text);
    // This slice's current work, else the prior's (a slice of tool results only).
    let current_work = match (&latest_assistant, tool_calls.last()) {
        (None, None) => carried.current,
        (text, last_call) => {
            let mut items = Vec::new();
            if let Some(text) = text {
                items.push(clip(text, max));
            }
            if let Some((name, args)) = last_call {
                items.push(format!(
                    "{LAST_CALL}{name}({})",
                    clip(args, MAX_ARGUMENT_CHARS)
                ));
            }
            items
        }
    };
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
        Some(first) => quote(&mut out, "   - ", first),
        None => item(
            &mut out,
            "No message of the user's own in the summarised turns.",
        ),
    }
    if carried.foreign.is_some() {
        item(
            &mut out,
            "Earlier requests are in the prior summary carried forward at the end.",
        );
    }
    if !system.is_empty() {
        out.push_str(SYSTEM_HEADER);
        out.push('\n');
        for instruction in &system {
            quote(&mut out, SYSTEM_LEAD, instruction);
        }
    }

    section(&mut out, 2, "Key Technical Concepts");
    if tools.is_empty() {
        item(&mut out, "No tools were used in the summarised turns.");
    } else {
        let list: Vec<String> = tools.iter().map(|(n, c)| format!("{n} ×{c}")).collect();
        item(&mut out, &format!("{TOOLS_USED}{}", list.join(", ")));
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
    if errors.is_empty() {
        item(&mut out, NO_ERRORS);
    }
    for line in &errors {
        item(&mut out, line);
    }

    section(&mut out, 5, "Problem Solving");
    if steps.is_empty() {
        item(&mut out, NO_STEPS);
    } else {
        if omitted > 0 {
            item(&mut out, &format!("({omitted}{OMITTED_TAIL}"));
        }
        for step in &steps {
            item(&mut out, step);
        }
    }

    section(&mut out, 6, "All user messages");
    if own_words.is_empty() {
        item(&mut out, "None in the summarised turns.");
    }
    for (i, words) in own_words.iter().enumerate() {
        quote(&mut out, &format!("   {}. ", i + 1), words);
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
                last
            ),
        ),
        None => item(&mut out, "None recorded."),
    }

    section(&mut out, 8, "Current Work");
    if current_work.is_empty() {
        item(&mut out, NO_CURRENT_WORK);
    }
    for line in &current_work {
        item(&mut out, line);
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

    if let Some(foreign) = &carried.foreign {
        let _ = writeln!(out, "\n{PRIOR_HEADER}");
        let room = if budget == 0 {
            usize::MAX
        } else {
            budget
                .saturating_sub(out.chars().count())
                .max(MIN_PRIOR_CHARS)
        };
        out.push_str(&cut(foreign, room));
        out.push('\n');
    }
    out
}

/// Heads the prior summary carried forward.
const PRIOR_HEADER: &str = "Prior summary (carried forward):";
/// How every summary of this backend starts: a prior that does is merged, not carried.
const OWN_OPENING: &str = "(Summary of compaction #";
/// Introduces the system instructions in section 1.
const SYSTEM_HEADER: &str =
    "   - System instructions given during the conversation (verbatim, in order):";
/// Leads each system instruction.
const SYSTEM_LEAD: &str = "     - ";
/// Opens section 6.
const USER_HEADER: &str = "6. All user messages:";
/// Leads each item of the other sections.
const ITEM_LEAD: &str = "   - ";
/// Starts section 2's list of tools.
const TOOLS_USED: &str = "Tools used: ";
/// Section 4 when no error was seen.
const NO_ERRORS: &str = "No errors seen in tool outputs.";
/// Section 5 when no tool was called.
const NO_STEPS: &str = "No tool calls in the summarised turns.";
/// Ends section 5's count of the steps left out, after the number.
const OMITTED_TAIL: &str = " earlier tool calls omitted; latest last)";
/// Section 8 when there is nothing to say.
const NO_CURRENT_WORK: &str = "No assistant text in the summarised turns.";
/// Starts section 8's last tool call.
const LAST_CALL: &str = "Last tool call: ";

/// What an earlier summary contributes to the next one.
#[derive(Debug, Default)]
struct Carried {
    /// Its section 6 items, as written (already cut), in order.
    user: Vec<String>,
    /// Its system instructions, as written.
    system: Vec<String>,
    /// Its tools with their call counts, in order of first use.
    tools: Vec<(String, usize)>,
    /// Its error lines, oldest first.
    errors: Vec<String>,
    /// Its steps (section 5's tool calls), oldest first.
    steps: Vec<String>,
    /// The steps it had already left out.
    omitted_steps: usize,
    /// Its current work (section 8's items).
    current: Vec<String>,
    /// A summary written by another backend: the prior itself, or the one a prior of this
    /// backend carried forward. It holds the only copy of what it summarised, so it is
    /// carried on.
    foreign: Option<String>,
}

/// Reads a prior summary for merging.
///
/// A summary of this backend's own (it starts with [`OWN_OPENING`]) is read section by
/// section at its top level, before any summary it carried forward: the lists come back as
/// items to merge with the new slice's, and the summary it carried forward (another
/// backend's) is carried on. Any other prior is carried forward whole.
fn carry(prior: &str) -> Carried {
    if !prior.starts_with(OWN_OPENING) {
        return Carried {
            foreign: Some(prior.to_owned()),
            ..Carried::default()
        };
    }
    let lines: Vec<&str> = prior.lines().collect();
    let top = lines
        .iter()
        .position(|l| *l == PRIOR_HEADER)
        .unwrap_or(lines.len());
    let foreign = lines
        .get(top + 1..)
        .map(|rest| rest.join("\n").trim().to_owned())
        .filter(|rest| !rest.is_empty());
    let lines = &lines[..top];
    let system = take_items(lines, SYSTEM_HEADER, |l| {
        l.starts_with(SYSTEM_LEAD).then_some(SYSTEM_LEAD.len())
    });
    let user = take_items(lines, USER_HEADER, numbered_lead);
    let tools = section_items(lines, 2)
        .find_map(|i| i.strip_prefix(TOOLS_USED))
        .map(parse_tool_counts)
        .unwrap_or_default();
    let errors = section_items(lines, 4)
        .filter(|i| *i != NO_ERRORS)
        .map(str::to_owned)
        .collect();
    let mut omitted_steps = 0;
    let mut steps = Vec::new();
    for step in section_items(lines, 5).filter(|i| *i != NO_STEPS) {
        match step
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(OMITTED_TAIL))
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => omitted_steps += n,
            None => steps.push(step.to_owned()),
        }
    }
    let current = section_items(lines, 8)
        .filter(|i| *i != NO_CURRENT_WORK)
        .map(str::to_owned)
        .collect();
    Carried {
        user,
        system,
        tools,
        errors,
        steps,
        omitted_steps,
        current,
        foreign,
    }
}

/// The one-line items (`   - …`) of section `n` among `lines`: from its `n. Title:` header
/// to the next blank line.
fn section_items<'a>(lines: &'a [&'a str], n: u32) -> impl Iterator<Item = &'a str> + 'a {
    let header = format!("{n}. ");
    let start = lines
        .iter()
        .position(|l| l.starts_with(&header) && l.ends_with(':'))
        .map_or(lines.len(), |i| i + 1);
    lines[start..]
        .iter()
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.strip_prefix(ITEM_LEAD))
}

/// `name ×count` pairs of a `Tools used:` list.
fn parse_tool_counts(list: &str) -> Vec<(String, usize)> {
    list.split(", ")
        .filter_map(|pair| {
            let (name, count) = pair.rsplit_once(" ×")?;
            Some((name.to_owned(), count.parse().ok()?))
        })
        .collect()
}

/// The length of a `   N. ` lead at the start of `line`, if it has one.
fn numbered_lead(line: &str) -> Option<usize> {
    let digits = line.strip_prefix("   ")?;
    let n = digits.len()
        - digits
            .trim_start_matches(|c: char| c.is_ascii_digit())
            .len();
    (n > 0 && digits[n..].starts_with(". ")).then_some(3 + n + 2)
}

/// The items after the first line equal to `header` in `lines`, as [`quote`] wrote them: an
/// item starts on a line where `lead` finds a lead, and runs on over the lines indented by
/// that lead's width (and the blank lines between them).
fn take_items(lines: &[&str], header: &str, lead: impl Fn(&str) -> Option<usize>) -> Vec<String> {
    let Some(start) = lines.iter().position(|l| *l == header) else {
        return Vec::new();
    };
    let mut items = Vec::new();
    let mut i = start + 1;
    while let Some(width) = lines.get(i).and_then(|l| lead(l)) {
        let mut text = lines[i][width..].to_owned();
        i += 1;
        let indent = " ".repeat(width);
        loop {
            // Blank lines belong to the item only when an indented line follows them.
            let next = (i..lines.len()).find(|&j| !lines[j].is_empty());
            match next {
                Some(j) if lines[j].starts_with(&indent) => {
                    text.extend(std::iter::repeat_n('\n', j - i + 1));
                    text.push_str(&lines[j][width..]);
                    i = j + 1;
                }
                _ => break,
            }
        }
        items.push(text);
    }
    items
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
    let _ = writeln!(out, "{ITEM_LEAD}{text}");
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

/// The prior's tool counts with the calls of this slice added, in order of first use.
fn merged_tool_counts(
    mut counts: Vec<(String, usize)>,
    calls: &[(&str, &str)],
) -> Vec<(String, usize)> {
    for (name, _) in calls {
        match counts.iter_mut().find(|(n, _)| n == name) {
            Some((_, c)) => *c += 1,
            None => counts.push(((*name).to_owned(), 1)),
        }
    }
    counts
}

/// The last `n` of `items`.
fn keep_last(mut items: Vec<String>, n: usize) -> Vec<String> {
    let skip = items.len().saturating_sub(n);
    items.split_off(skip)
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
    keep_last(lines, MAX_ERROR_LINES)
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

/// Shortest a quote is cut to when the lists must shrink: its first and last 30 characters.
const MIN_QUOTE_CHARS: usize = 60;

/// Bounds the cumulative lists to about `share` characters without dropping an item: the
/// older quotes (every one but the latest user message, which keeps its cut at `max`) are cut
/// shorter, in the middle, halving the length each round, until the lists fit or every quote
/// is down to [`MIN_QUOTE_CHARS`]. Agents in text mode (SWE-agent) send every observation as a
/// user message, so a long session would otherwise grow its summary without bound.
fn fit_lists(own: &mut [String], system: &mut [String], max: usize, share: usize) {
    let total = |own: &[String], system: &[String]| -> usize {
        own.iter()
            .chain(system.iter())
            .map(|q| q.chars().count())
            .sum()
    };
    let older = own.len().saturating_sub(1);
    let mut limit = max;
    while total(own, system) > share && limit > MIN_QUOTE_CHARS {
        limit = (limit / 2).max(MIN_QUOTE_CHARS);
        for quote in own[..older].iter_mut().chain(system.iter_mut()) {
            if quote.chars().count() > limit {
                *quote = cut_middle(quote, limit);
            }
        }
    }
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
            in_conversation: None,
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
    fn user_messages_and_system_instructions_survive_any_number_of_refinements() {
        // Each compaction refines the previous summary under a small budget, so the prior
        // carried forward is cut every time: the lists must not live only inside it.
        let mut prior: Option<String> = None;
        for k in 0..12 {
            let mut entries = vec![text(Role::User, &format!("request {k}: fix bug #{k}"))];
            if k == 2 {
                entries.push(text(Role::User, "[system] SYSTEM-MID: answer in French"));
                entries.push(text(Role::User, "first line\n\n  indented after a blank"));
            }
            entries.push(text(Role::Assistant, &"working on it ".repeat(40)));
            let mut r = request(entries);
            r.prior_summary = prior.take();
            r.max_output_tokens = 400;
            prior = Some(extract(&r, &ExtractiveConfig::default()));
        }
        let s = prior.expect("a summary");
        let six = &s[s.find("6. All user messages:").expect("section 6")
            ..s.find("7. Pending Tasks:").expect("section 7")];
        let mut n = 0;
        for k in 0..12 {
            n += 1;
            assert!(
                six.contains(&format!("   {n}. request {k}: fix bug #{k}\n")),
                "{s}"
            );
            if k == 2 {
                n += 1;
                assert!(
                    six.contains(&format!(
                        "   {n}. first line\n\n        indented after a blank\n"
                    )),
                    "multi-line words round-trip: {s}"
                );
            }
        }
        assert_eq!(s.matches("SYSTEM-MID: answer in French").count(), 1, "{s}");
        assert!(
            s.contains(&format!("{SYSTEM_LEAD}[system] SYSTEM-MID")),
            "{s}"
        );
        assert!(
            s.contains(&format!("6.{n}): request 11")),
            "pending refers to the last"
        );
        assert!(s.starts_with("(Summary of compaction"));
        assert!(
            s.contains("   - request 0: fix bug #0\n"),
            "the first request stays primary"
        );
    }

    #[test]
    fn long_sessions_shorten_older_quotes_but_drop_none() {
        // A text-mode agent sends every observation as a user message: 60 refinements of
        // 400-character messages would make section 6 grow to 24,000 characters.
        let mut prior: Option<String> = None;
        for k in 0..60 {
            let words = format!("obs {k:02}: {} end {k:02}", "x".repeat(380));
            let mut r = request(vec![text(Role::User, &words), text(Role::Assistant, "ok")]);
            r.prior_summary = prior.take();
            r.max_output_tokens = 1_000;
            prior = Some(extract(&r, &ExtractiveConfig::default()));
        }
        let s = prior.expect("a summary");
        let six = &s[s.find("6. All user messages:").expect("section 6")
            ..s.find("7. Pending Tasks:").expect("section 7")];
        // Every older quote is down to its floor (head, marker, tail): about 100 characters a
        // line instead of 400.
        let bound = 60 * (MIN_QUOTE_CHARS + 40);
        assert!(six.chars().count() < bound, "{}", six.chars().count());
        for k in 0..60 {
            assert!(six.contains(&format!("obs {k:02}: ")), "head of {k}: {six}");
            assert!(six.contains(&format!(" end {k:02}\n")), "tail of {k}");
        }
        // The latest keeps its full cut.
        assert!(six.contains(&format!("obs 59: {}", "x".repeat(200))));
    }

    /// A slice of a session: the agent's text, then `bash` called `calls` times, each output
    /// reporting an error numbered from `first`.
    fn slice(k: usize, calls: usize, first: usize) -> Vec<Entry> {
        let mut parts = vec![Part::Text {
            text: format!("step {k}: looking into it"),
        }];
        for i in 0..calls {
            parts.push(Part::ToolCall {
                name: "bash".into(),
                arguments: format!("{{\"command\": \"make test-{k}-{i}\"}}"),
            });
            parts.push(Part::ToolResult {
                name: "bash".into(),
                output: format!("compiling\nerror: failure number {}", first + i),
                is_error: false,
            });
        }
        vec![Entry {
            role: Role::Assistant,
            parts,
        }]
    }

    #[test]
    fn refinements_merge_into_one_summary_of_about_the_same_size() {
        // Each compaction refines the previous summary: tool counts add up, steps and error
        // lines run on across slices under the same caps, the current work is the latest,
        // and nothing is nested, so the 30th summary is about as long as the 3rd.
        let mut prior: Option<String> = None;
        let mut sizes = Vec::new();
        for k in 0..30 {
            let mut entries = slice(k, 3, 3 * k);
            if k == 0 {
                entries.insert(0, text(Role::User, "make the tests pass"));
            }
            entries.push(Entry {
                role: Role::Assistant,
                parts: vec![Part::ToolCall {
                    name: "edit".into(),
                    arguments: format!("{{\"path\": \"src/m{k}.rs\"}}"),
                }],
            });
            let mut r = request(entries);
            r.prior_summary = prior.take();
            r.max_output_tokens = 4_096;
            let s = extract(&r, &ExtractiveConfig::default());
            sizes.push(s.len());
            prior = Some(s);
        }
        let s = prior.expect("a summary");
        assert!(!s.contains(PRIOR_HEADER), "nothing nested: {s}");
        assert!(s.contains("Tools used: bash ×90, edit ×30"), "{s}");
        // 120 calls in all, the last 12 listed, oldest first, across the last 3 slices.
        assert!(
            s.contains("(108 earlier tool calls omitted; latest last)"),
            "{s}"
        );
        let five = &s[s.find("5. Problem Solving:").expect("5")..s.find("6. All").expect("6")];
        assert_eq!(
            five.matches("   - bash(").count() + five.matches("   - edit(").count(),
            12
        );
        assert!(
            five.find("make test-27-0").expect("27") < five.find("make test-29-2").expect("29")
        );
        // The last 8 distinct error lines of the session, wherever they were seen.
        let four = &s[s.find("4. Errors").expect("4")..s.find("5. Problem").expect("5")];
        for n in 82..90 {
            assert!(
                four.contains(&format!("failure number {n}\n")),
                "{n}: {four}"
            );
        }
        assert!(!four.contains("failure number 81\n"), "{four}");
        assert!(s.contains("   1. make the tests pass\n"), "{s}");
        assert!(s.contains(
            "8. Current Work:\n   - step 29: looking into it\n   - Last tool call: edit("
        ));
        // Bounded: the last summary within a tenth of the third (the numbers grow a digit).
        assert!(sizes[29] < sizes[2] + sizes[2] / 10, "{sizes:?}");
    }

    #[test]
    fn a_slice_without_assistant_text_or_calls_keeps_the_prior_current_work() {
        let mut first = request(slice(0, 1, 0));
        first.entries.insert(0, text(Role::User, "fix it"));
        let prior = extract(&first, &ExtractiveConfig::default());
        let mut next = request(vec![text(Role::User, "and the docs")]);
        next.prior_summary = Some(prior);
        let s = extract(&next, &ExtractiveConfig::default());
        assert!(
            s.contains(
                "8. Current Work:\n   - step 0: looking into it\n   - Last tool call: bash("
            ),
            "{s}"
        );
        assert!(s.contains("   1. fix it\n   2. and the docs\n"), "{s}");
        assert!(s.contains("Tools used: bash ×1"), "{s}");
        assert!(s.contains("   - [bash] error: failure number 0\n"), "{s}");
    }

    #[test]
    fn another_backends_summary_is_carried_on_through_merges() {
        // An LLM wrote the first summary, the extractive fallback the next two: the LLM's
        // text holds the only copy of what it summarised, so every merge carries it on.
        let mut prior = Some("LLM SUMMARY: the user asked for a CLI in Rust".to_owned());
        for k in 0..3 {
            let mut r = request(slice(k, 1, k));
            r.prior_summary = prior.take();
            r.max_output_tokens = 4_096;
            prior = Some(extract(&r, &ExtractiveConfig::default()));
        }
        let s = prior.expect("a summary");
        assert_eq!(s.matches(PRIOR_HEADER).count(), 1, "{s}");
        assert!(
            s.ends_with(
                "Prior summary (carried forward):\nLLM SUMMARY: the user asked for a CLI in Rust\n"
            ),
            "{s}"
        );
        assert!(s.contains("Earlier requests are in the prior summary carried forward"));
        assert!(s.contains("Tools used: bash ×3"), "{s}");
    }

    #[test]
    fn a_prior_from_another_backend_is_carried_whole() {
        let mut r = request(vec![text(Role::User, "go on")]);
        r.prior_summary = Some(
            "1. Primary Request: the user wanted a CLI\n6. All user messages:\n- build a CLI"
                .into(),
        );
        let s = extract(&r, &ExtractiveConfig::default());
        assert!(s.contains("Earlier requests are in the prior summary carried forward"));
        assert!(s.ends_with("6. All user messages:\n- build a CLI\n"), "{s}");
        assert!(s.contains("   1. go on\n"));
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
