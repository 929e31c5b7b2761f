//! The compaction prompt and the summary message (docs/architecture.md, *Compaction prompt*
//! and *Summary message*).
//!
//! Turns to summarise become [`Entry`] values (tool results folded into the assistant turn
//! that called the tool, names resolved from the call ids), text truncated to
//! [`MAX_TEXT_CHARS`], tool arguments to [`MAX_TOOL_ARGS_CHARS`] and tool outputs to
//! [`MAX_TOOL_OUTPUT_CHARS`] characters. The prompt is laid out as `<task>` with the nine
//! numbered summary sections (and any focus instructions), `<conversation>` with an optional
//! `<prior-summary>` and `<user>`/`<assistant>` blocks, then `<read-files>` and
//! `<modified-files>`. When the prompt would not fit the summarizer's
//! window (after masking and truncation), the oldest turns are dropped and the prompt says
//! how many. [`summary_message`] renders what replaces the compacted turns in the request.

use std::fmt::Write as _;

use compactor_plugin_api::{split_user_text, Entry, Part as EntryPart, Role as EntryRole};

use crate::estimate::{text_weight, LazyEstimator};
use crate::transcript::{Message, Part, Role};

/// Text (and reasoning) parts are cut to this many characters in the prompt.
pub const MAX_TEXT_CHARS: usize = 2_000;
/// Tool-call arguments are cut to this many characters in the prompt.
pub const MAX_TOOL_ARGS_CHARS: usize = 500;
/// Tool outputs are cut to this many characters in the prompt.
pub const MAX_TOOL_OUTPUT_CHARS: usize = 2_000;

/// How much of each tool output a compaction reads: [`MAX_TOOL_OUTPUT_CHARS`] characters, and
/// one more to tell [`truncate`] that the output goes on. Cutting each text of an output there
/// before the prompt is built leaves the prompt as it would be: flattened, the output starts
/// with the same characters and is cut at the same place.
pub const OUTPUT_CHARS_READ: usize = MAX_TOOL_OUTPUT_CHARS + 1;

/// Appended to anything cut short.
pub const TRUNCATION_MARKER: &str = " [...truncated]";

/// The nine summary sections, in order: (name, what goes in it).
pub const SUMMARY_SECTIONS: [(&str, &str); 9] = [
    ("Primary Request and Intent", "User's ultimate goal"),
    (
        "Key Technical Concepts",
        "Architecture, patterns, decisions",
    ),
    (
        "Files and Code Sections",
        "Paths, functions, code discussed/modified",
    ),
    ("Errors and fixes", "Problems and solutions"),
    ("Problem Solving", "Key decisions and rationale"),
    ("All user messages", "Every user instruction, in order"),
    ("Pending Tasks", "Remaining work"),
    (
        "Current Work",
        "What was being worked on at compaction time",
    ),
    ("Optional Next Step", "Most logical next action"),
];

/// Opens the task block.
const TASK_INTRO: &str = "Summarize the conversation so far. The summary will replace the \
earlier messages, so the work must be able to continue from it alone: keep file paths, \
function names, commands, error messages and the user's instructions exactly as written. If a \
<prior-summary> is present, it covers the conversation before the messages shown: merge it \
with them into one updated summary. The <read-files> and <modified-files> lists are appended \
to your summary automatically: do not copy them, name only the files that matter and why. \
Reply with the summary only, using these sections:";

/// Opens the message that replaces the compacted turns.
pub const SUMMARY_INTRO: &str = "This session is being continued from a previous conversation \
that was compacted to fit the context window. Summary of the earlier conversation:";

/// Why no prompt could be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    /// Even without any turn the prompt exceeds what the summarizer can read.
    #[error("compaction prompt needs {needed} tokens, the summarizer can read {limit}")]
    TooLarge {
        /// Estimated tokens of the smallest prompt.
        needed: usize,
        /// Tokens available for the prompt.
        limit: usize,
    },
}

/// `text` cut to at most `max` characters (on a character boundary) plus
/// [`TRUNCATION_MARKER`]; unchanged when short enough.
pub fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((cut, _)) => {
            let mut out = String::with_capacity(cut + TRUNCATION_MARKER.len());
            out.push_str(&text[..cut]);
            out.push_str(TRUNCATION_MARKER);
            out
        }
    }
}

/// The turns of `messages` as summarizer entries, untruncated. System messages in the middle
/// of a conversation become user turns marked `[system]`; tool results (tool-role messages and
/// the tool-result parts of user messages) join the assistant turn before them.
pub fn to_entries(messages: &[Message]) -> Vec<Entry> {
    to_entries_masking(messages, 0)
}

/// The tool outputs in `messages` (tool-role messages and tool-result parts), as
/// [`mask_observations`](super::mask_rule::mask_observations) counts them in their entries.
pub fn count_outputs(messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| match m.role {
            Role::Tool => 1,
            _ => m
                .parts
                .iter()
                .filter(|p| matches!(p, Part::ToolResult(_)))
                .count(),
        })
        .sum()
}

/// [`to_entries`] with the first `masked` tool outputs already reading
/// [`MASKED_OUTPUT`](super::mask_rule::MASKED_OUTPUT), as
/// [`mask_observations`](super::mask_rule::mask_observations) would leave them, without copying
/// them first: a large request's outputs are most of its bytes, and a copy of each only to
/// throw it away doubled what a compaction held.
pub fn to_entries_masking(messages: &[Message], masked: usize) -> Vec<Entry> {
    let mut left = masked;
    let mut output = |content: &[Part]| {
        if left > 0 {
            left -= 1;
            super::mask_rule::MASKED_OUTPUT.to_string()
        } else {
            flatten(content)
        }
    };
    let mut entries: Vec<Entry> = Vec::new();
    for m in messages {
        match m.role {
            Role::Tool => {
                let part = EntryPart::ToolResult {
                    name: m.tool_name.clone().unwrap_or_else(|| "tool".into()),
                    output: output(&m.parts),
                    is_error: false,
                };
                match entries.last_mut() {
                    Some(e) if e.role == EntryRole::Assistant => e.parts.push(part),
                    _ => entries.push(Entry {
                        role: EntryRole::Assistant,
                        parts: vec![part],
                    }),
                }
            }
            Role::System => entries.push(Entry {
                role: EntryRole::User,
                parts: vec![EntryPart::Text {
                    text: format!("[system] {}", flatten(&m.parts)),
                }],
            }),
            Role::User => {
                // Tool-result parts (Anthropic) join the assistant turn that made the calls;
                // whatever else the message says is the user's.
                let (results, rest): (Vec<&Part>, Vec<&Part>) = m
                    .parts
                    .iter()
                    .partition(|p| matches!(p, Part::ToolResult(_)));
                if !results.is_empty() {
                    let parts = results
                        .into_iter()
                        .map(|p| result_part(p, &mut output))
                        .collect::<Vec<_>>();
                    match entries.last_mut() {
                        Some(e) if e.role == EntryRole::Assistant => e.parts.extend(parts),
                        _ => entries.push(Entry {
                            role: EntryRole::Assistant,
                            parts,
                        }),
                    }
                    if rest.is_empty() {
                        continue;
                    }
                }
                entries.push(Entry {
                    role: EntryRole::User,
                    parts: user_parts(&rest),
                });
            }
            Role::Assistant => {
                let parts = m
                    .parts
                    .iter()
                    .map(|p| result_part(p, &mut output))
                    .collect();
                entries.push(Entry {
                    role: EntryRole::Assistant,
                    parts,
                });
            }
        }
    }
    entries
}

/// A user turn's parts with the person's own words first: the own words of every text part
/// (in order), then the injected context the agent put around them, then everything else
/// (images, opaque parts). Agents such as Claude Code send their context blocks before the
/// typed words; leading with the words means the summarizer reads them first and any
/// truncation of the turn cuts context, not what the person asked.
fn user_parts(parts: &[&Part]) -> Vec<EntryPart> {
    let mut own = Vec::new();
    let mut context = Vec::new();
    let mut other = Vec::new();
    for part in parts {
        match part {
            Part::Text(text) => {
                let split = split_user_text(text);
                if !split.own_words.is_empty() {
                    own.push(EntryPart::Text {
                        text: split.own_words,
                    });
                }
                if !split.context.is_empty() {
                    context.push(EntryPart::Text {
                        text: split.context,
                    });
                }
            }
            other_part => other.push(entry_part(other_part)),
        }
    }
    own.extend(context);
    own.extend(other);
    own
}

/// [`entry_part`], with a tool result's output from `output`.
fn result_part(part: &Part, output: &mut impl FnMut(&[Part]) -> String) -> EntryPart {
    match part {
        Part::ToolResult(result) => EntryPart::ToolResult {
            name: result.name.clone().unwrap_or_else(|| "tool".into()),
            output: output(&result.content),
            is_error: result.is_error,
        },
        other => entry_part(other),
    }
}

fn entry_part(part: &Part) -> EntryPart {
    match part {
        Part::Text(text) => EntryPart::Text { text: text.clone() },
        Part::Image => EntryPart::Text {
            text: "[image]".into(),
        },
        Part::Opaque { kind, .. } => EntryPart::Text {
            text: format!("[{kind}]"),
        },
        Part::ToolCall(call) => EntryPart::ToolCall {
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        },
        Part::Reasoning(text) => EntryPart::Reasoning { text: text.clone() },
        Part::ToolResult(result) => EntryPart::ToolResult {
            name: result.name.clone().unwrap_or_else(|| "tool".into()),
            output: flatten(&result.content),
            is_error: result.is_error,
        },
    }
}

/// The parts of a message as one text (tool outputs, mid-conversation system messages).
fn flatten(parts: &[Part]) -> String {
    let mut out = String::new();
    for part in parts {
        let nested;
        let piece = match part {
            Part::Text(t) | Part::Reasoning(t) => t.as_str(),
            Part::Image => "[image]",
            Part::Opaque { kind, .. } => kind.as_str(),
            Part::ToolCall(call) => call.name.as_str(),
            Part::ToolResult(result) => {
                nested = flatten(&result.content);
                nested.as_str()
            }
        };
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(piece);
    }
    out
}

/// Applies the truncation limits to every part.
pub fn truncate_entries(entries: &mut [Entry]) {
    for part in entries.iter_mut().flat_map(|e| e.parts.iter_mut()) {
        match part {
            EntryPart::Text { text } | EntryPart::Reasoning { text } => {
                *text = truncate(text, MAX_TEXT_CHARS)
            }
            EntryPart::ToolCall { arguments, .. } => {
                *arguments = truncate(arguments, MAX_TOOL_ARGS_CHARS)
            }
            EntryPart::ToolResult { output, .. } => {
                *output = truncate(output, MAX_TOOL_OUTPUT_CHARS)
            }
        }
    }
}

/// What goes into a compaction prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptInput<'a> {
    /// The summary of the previous compaction, if any.
    pub prior_summary: Option<&'a str>,
    /// Files read so far.
    pub read_files: &'a [String],
    /// Files modified so far.
    pub modified_files: &'a [String],
    /// Focus instructions of a manual compaction.
    pub instructions: Option<&'a str>,
}

/// A prompt that fits.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltPrompt {
    /// The rendered prompt.
    pub prompt: String,
    /// The entries it shows (the oldest may have been dropped).
    pub entries: Vec<Entry>,
    /// How many of the oldest entries were dropped to fit.
    pub omitted: usize,
}

/// Renders the prompt for `entries` (already masked and truncated), leaving entries out until
/// its estimate is at most `max_tokens`: the oldest assistant turns first (tool calls and
/// outputs, the bulk of an agent's context), and only when none is left the oldest user turns,
/// so what the person said (and mid-conversation system messages, which are user entries
/// here) is the last thing a small summarizer window loses.
pub fn build_prompt(
    input: &PromptInput<'_>,
    entries: Vec<Entry>,
    max_tokens: usize,
    estimator: &LazyEstimator,
) -> Result<BuiltPrompt, PromptError> {
    let rendered: Vec<String> = entries.iter().map(render_entry).collect();
    // The weight of concatenated text is the sum of the pieces' weights, so the prompt's
    // weight is followed as entries are left out, without rendering it again.
    let fixed = text_weight(&render(input, &[], 0).text);
    let notice_weight = text_weight(&omission_notice(entries.len())) + text_weight("\n");
    let limit = estimator.weight_for_tokens(max_tokens);

    let mut total = rendered
        .iter()
        .fold(fixed, |acc, r| acc.saturating_add(text_weight(r)));
    let mut keep = vec![true; entries.len()];
    let mut omitted = 0;
    let roles: Vec<EntryRole> = entries.iter().map(|e| e.role).collect();
    let roles = &roles;
    let by_age_assistants_first = [EntryRole::Assistant, EntryRole::User]
        .into_iter()
        .flat_map(|role| (0..roles.len()).filter(move |&i| roles[i] == role));
    for i in by_age_assistants_first {
        if total <= limit {
            break;
        }
        total = total.saturating_sub(text_weight(&rendered[i]));
        if omitted == 0 {
            total = total.saturating_add(notice_weight);
        }
        keep[i] = false;
        omitted += 1;
    }
    let shown: Vec<String> = rendered
        .into_iter()
        .zip(&keep)
        .filter_map(|(r, &k)| k.then_some(r))
        .collect();
    let prompt = render(input, &shown, omitted).text;
    let needed = estimator.text(&prompt);
    if needed > max_tokens {
        return Err(PromptError::TooLarge {
            needed,
            limit: max_tokens,
        });
    }
    let entries = entries
        .into_iter()
        .zip(keep)
        .filter_map(|(e, k)| k.then_some(e))
        .collect();
    Ok(BuiltPrompt {
        prompt,
        entries,
        omitted,
    })
}

struct Rendered {
    text: String,
}

fn omission_notice(omitted: usize) -> String {
    format!(
        "[{omitted} earlier turns omitted to fit the summarizer's context window, \
         the model's turns first]"
    )
}

fn render(input: &PromptInput<'_>, entries: &[String], omitted: usize) -> Rendered {
    let mut s = String::with_capacity(4096 + entries.iter().map(String::len).sum::<usize>());
    task(&mut s, TASK_INTRO, input.instructions);
    s.push_str("\n<conversation>\n");
    if let Some(prior) = input.prior_summary {
        s.push_str("<prior-summary>\n");
        s.push_str(prior.trim_end());
        s.push_str("\n</prior-summary>\n\n");
    }
    if omitted > 0 {
        s.push_str(&omission_notice(omitted));
        s.push('\n');
    }
    for e in entries {
        s.push_str(e);
    }
    s.push_str("</conversation>\n\n");
    file_lists(&mut s, input);
    Rendered { text: s }
}

/// The user turn that asks for the summary inside the conversation
/// ([`SummaryRequest::in_conversation`](compactor_plugin_api::SummaryRequest::in_conversation)):
/// the standalone prompt's task and file lists, the conversation being the messages above it
/// (an earlier summary among them), so nothing of it is repeated.
pub fn follow_up_prompt(input: &PromptInput<'_>) -> String {
    let mut s = String::with_capacity(4096);
    task(&mut s, FOLLOW_UP_INTRO, input.instructions);
    s.push('\n');
    file_lists(&mut s, input);
    s
}

/// Opens the task of [`follow_up_prompt`].
const FOLLOW_UP_INTRO: &str = "Stop here: do not call any tool and do not continue the task. \
Summarize the conversation above instead. The summary will replace it, so the work must be \
able to continue from it alone: keep file paths, function names, commands, error messages and \
the user's instructions exactly as written. If the conversation opens with a summary of an \
earlier part, merge it with what follows into one updated summary. The <read-files> and \
<modified-files> lists below are appended to your summary automatically: do not copy them, \
name only the files that matter and why. Reply with the summary only, using these sections:";

/// Words the task asks a summary to stay within (about 1,000 tokens). What a compaction
/// costs is mostly its summary: written at the output price, then read again with every later
/// request, so a summary half as long makes compacting pay twice as soon (the cost trigger
/// weighs the summary in use). The nine sections of an agent's session fit in it when the file
/// lists are appended separately, as they are; the `extractive` backend writes 600 to 1,000
/// tokens on the replayed sessions, every user message and error line included.
pub const SUMMARY_TARGET_WORDS: usize = 750;

/// `<task>`: `intro`, the numbered sections, the length to aim for and any focus instructions.
fn task(s: &mut String, intro: &str, instructions: Option<&str>) {
    s.push_str("<task>\n");
    s.push_str(intro);
    s.push('\n');
    for (i, (name, what)) in SUMMARY_SECTIONS.iter().enumerate() {
        let _ = writeln!(s, "{}. {name} — {what}", i + 1);
    }
    let _ = writeln!(
        s,
        "Keep it short: the summary is sent again with every later request. Aim for at most \
         about {SUMMARY_TARGET_WORDS} words, but never leave out a user instruction, a file path \
         or an error message to get there."
    );
    if let Some(focus) = instructions.map(str::trim).filter(|f| !f.is_empty()) {
        s.push_str("\nFocus instructions for this summary: ");
        s.push_str(focus);
        s.push('\n');
    }
    s.push_str("</task>\n");
}

/// `<read-files>` and `<modified-files>`.
fn file_lists(s: &mut String, input: &PromptInput<'_>) {
    s.push_str("<read-files>\n");
    for f in input.read_files {
        s.push_str(f);
        s.push('\n');
    }
    s.push_str("</read-files>\n\n<modified-files>\n");
    for f in input.modified_files {
        s.push_str(f);
        s.push('\n');
    }
    s.push_str("</modified-files>\n");
}

/// One `<user>`/`<assistant>` block.
pub fn render_entry(entry: &Entry) -> String {
    let tag = match entry.role {
        EntryRole::User => "user",
        EntryRole::Assistant => "assistant",
    };
    let mut s = format!("<{tag}>\n");
    for part in &entry.parts {
        match part {
            EntryPart::Text { text } => s.push_str(text),
            EntryPart::ToolCall { name, arguments } => {
                let _ = write!(s, "[tool_call: {name}({arguments})]");
            }
            EntryPart::ToolResult { name, output, .. } => {
                let _ = write!(s, "[tool_result: {name} = {output}]");
            }
            EntryPart::Reasoning { text } => {
                let _ = write!(s, "[reasoning: {text}]");
            }
        }
        s.push('\n');
    }
    let _ = writeln!(s, "</{tag}>");
    s
}

/// The user message that replaces the compacted turns: an introduction saying it summarises
/// an earlier conversation, the summary, and the files read and modified so far.
pub fn summary_message(summary: &str, read_files: &[String], modified_files: &[String]) -> String {
    let mut s = String::with_capacity(SUMMARY_INTRO.len() + summary.len() + 256);
    s.push_str(SUMMARY_INTRO);
    s.push_str("\n\n");
    s.push_str(summary.trim());
    for (title, files) in [
        ("Files read so far:", read_files),
        ("Files modified so far:", modified_files),
    ] {
        if files.is_empty() {
            continue;
        }
        s.push_str("\n\n");
        s.push_str(title);
        for f in files {
            s.push_str("\n- ");
            s.push_str(f);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::tests::{call, text};
    use crate::transcript::Transcript;

    #[test]
    fn truncation_limits_are_2000_500_2000() {
        assert_eq!(MAX_TEXT_CHARS, 2_000);
        assert_eq!(MAX_TOOL_ARGS_CHARS, 500);
        assert_eq!(MAX_TOOL_OUTPUT_CHARS, 2_000);
    }

    #[test]
    fn nine_sections_in_order() {
        let names: Vec<&str> = SUMMARY_SECTIONS.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "Primary Request and Intent",
                "Key Technical Concepts",
                "Files and Code Sections",
                "Errors and fixes",
                "Problem Solving",
                "All user messages",
                "Pending Tasks",
                "Current Work",
                "Optional Next Step",
            ]
        );
    }

    #[test]
    fn both_prompts_ask_for_a_short_summary_after_the_sections() {
        let input = PromptInput {
            prior_summary: None,
            read_files: &[],
            modified_files: &[],
            instructions: Some("the parser"),
        };
        let standalone = build_prompt(&input, Vec::new(), 100_000, &LazyEstimator::default())
            .expect("fits")
            .prompt;
        for prompt in [standalone, follow_up_prompt(&input)] {
            let target = format!("Aim for at most about {SUMMARY_TARGET_WORDS} words");
            let at = prompt.find(&target).expect("the length to aim for");
            assert!(
                prompt.find("9. Optional Next Step").expect("sections") < at,
                "{prompt}"
            );
            assert!(
                at < prompt.find("Focus instructions").expect("focus"),
                "{prompt}"
            );
            assert!(
                at < prompt.find("</task>").expect("end of task"),
                "{prompt}"
            );
        }
    }

    #[test]
    fn truncation_is_char_boundary_safe() {
        assert_eq!(truncate("abc", 3), "abc");
        assert_eq!(truncate("abcd", 3), format!("abc{TRUNCATION_MARKER}"));
        let s = "é".repeat(10);
        assert_eq!(truncate(&s, 4), format!("éééé{TRUNCATION_MARKER}"));
        let crab = "🦀".repeat(3);
        assert_eq!(truncate(&crab, 2), format!("🦀🦀{TRUNCATION_MARKER}"));
        assert_eq!(truncate("", 0), "");
    }

    #[test]
    fn each_part_kind_has_its_limit() {
        let mut entries = vec![Entry {
            role: EntryRole::Assistant,
            parts: vec![
                EntryPart::Text {
                    text: "t".repeat(2_001),
                },
                EntryPart::ToolCall {
                    name: "bash".into(),
                    arguments: "a".repeat(501),
                },
                EntryPart::ToolResult {
                    name: "bash".into(),
                    output: "o".repeat(2_001),
                    is_error: false,
                },
                EntryPart::Reasoning {
                    text: "r".repeat(2_000),
                },
            ],
        }];
        truncate_entries(&mut entries);
        let marker = TRUNCATION_MARKER.chars().count();
        let lens: Vec<usize> = entries[0]
            .parts
            .iter()
            .map(|p| match p {
                EntryPart::Text { text } | EntryPart::Reasoning { text } => text.chars().count(),
                EntryPart::ToolCall { arguments, .. } => arguments.chars().count(),
                EntryPart::ToolResult { output, .. } => output.chars().count(),
            })
            .collect();
        assert_eq!(
            lens,
            vec![2_000 + marker, 500 + marker, 2_000 + marker, 2_000]
        );
    }

    #[test]
    fn masking_while_converting_is_masking_after_converting() {
        // Chat tool messages and Anthropic tool_result parts (two in one user message),
        // between turns with text: the first k outputs read as masked either way.
        let result = |id: &str, out: &str| {
            Part::ToolResult(crate::transcript::ToolResult {
                call_id: Some(id.into()),
                name: Some("read".into()),
                content: vec![Part::Text(out.into())],
                is_error: false,
            })
        };
        let messages = vec![
            text(Role::User, "fix it"),
            Message::new(Role::Assistant, vec![call("c1", "read", "{}")]),
            Message::tool_result(Some("c1".into()), "output one"),
            Message::new(
                Role::Assistant,
                vec![call("c2", "read", "{}"), call("c3", "read", "{}")],
            ),
            Message::new(
                Role::User,
                vec![
                    result("c2", "output two"),
                    result("c3", "output three"),
                    Part::Text("go on".into()),
                ],
            ),
            Message::new(Role::Assistant, vec![call("c4", "read", "{}")]),
            Message::tool_result(Some("c4".into()), "output four"),
        ];
        let total = count_outputs(&messages);
        assert_eq!(total, 4);
        for k in 0..=total + 1 {
            let mut expected = to_entries(&messages);
            crate::compaction::mask_rule::mask_observations(&mut expected, total.saturating_sub(k));
            assert_eq!(to_entries_masking(&messages, k), expected, "{k} masked");
        }
    }

    /// Text of `len` characters drawn from ASCII, two- and three-byte characters and line
    /// breaks, so a cut by characters and one by bytes differ.
    fn varied_text(len: usize, seed: usize) -> String {
        const CHARS: [char; 6] = ['a', 'é', '漢', '\n', ' ', 'z'];
        (0..len)
            .map(|i| CHARS[(i * 7 + seed) % CHARS.len()])
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A transcript whose outputs were cut to [`OUTPUT_CHARS_READ`] characters makes the
        /// same prompt entries as the whole one, whatever is masked: outputs of one text or
        /// several (a multi-part output is flattened before it is cut), nested, of any length
        /// around the limit; the texts that are not outputs are left whole.
        #[test]
        fn outputs_cut_to_what_is_read_make_the_same_entries(
            lens in proptest::collection::vec(0usize..4_200, 1..7),
            near in proptest::collection::vec(1_990usize..2_010, 0..3),
            seed in 0usize..6,
        ) {
            let lens: Vec<usize> = lens.into_iter().chain(near).collect();
            let texts: Vec<String> = lens.iter().enumerate().map(|(i, &n)| varied_text(n, seed + i)).collect();
            let result = |id: &str, content: Vec<Part>| {
                Part::ToolResult(crate::transcript::ToolResult {
                    call_id: Some(id.into()),
                    name: Some("read".into()),
                    content,
                    is_error: false,
                })
            };
            let mut tool = Message::tool_result(Some("c1".into()), texts[0].clone());
            tool.parts.extend(texts[1..].iter().take(2).map(|t| Part::Text(t.clone())));
            tool.parts.push(Part::Image);
            let long_user = varied_text(5_000, seed);
            let messages = vec![
                text(Role::User, &long_user),
                Message::new(Role::Assistant, vec![Part::Text(long_user.clone()), call("c1", "read", "{}")]),
                tool,
                Message::new(Role::Assistant, vec![call("c2", "read", "{}"), call("c3", "read", "{}")]),
                Message::new(Role::User, vec![
                    result("c2", texts.iter().rev().map(|t| Part::Text(t.clone())).collect()),
                    result("c3", vec![
                        Part::Reasoning(texts[texts.len() / 2].clone()),
                        result("nested", vec![Part::Text(texts[texts.len() - 1].clone())]),
                    ]),
                    Part::Text(long_user.clone()),
                ]),
            ];
            let mut cut = messages.clone();
            cut.iter_mut().for_each(|m| m.cut_outputs(OUTPUT_CHARS_READ));
            // Texts outside outputs are whole; every output text is at most the cut.
            proptest::prop_assert_eq!(&cut[0], &messages[0]);
            proptest::prop_assert_eq!(&cut[1], &messages[1]);
            proptest::prop_assert_eq!(&cut[4].parts[2], &messages[4].parts[2]);
            let entries = |m: &[Message], k: usize| {
                let mut e = to_entries_masking(m, k);
                truncate_entries(&mut e);
                e
            };
            for k in 0..=count_outputs(&messages) {
                proptest::prop_assert_eq!(entries(&cut, k), entries(&messages, k), "{} masked", k);
            }
        }
    }

    #[test]
    fn an_output_is_cut_by_characters_and_frees_the_rest() {
        let mut m = Message::tool_result(None, varied_text(10_000, 1));
        let whole = m.clone();
        m.cut_outputs(OUTPUT_CHARS_READ);
        let Part::Text(cut) = &m.parts[0] else {
            panic!("a text part")
        };
        assert_eq!(cut.chars().count(), OUTPUT_CHARS_READ);
        assert!(
            cut.capacity() < 3 * OUTPUT_CHARS_READ,
            "{} bytes kept",
            cut.capacity()
        );
        assert!(whole.text().starts_with(cut.as_str()));
        // The estimate is the whole message's.
        assert_eq!(m.tokens, whole.tokens);
    }

    #[test]
    fn tool_results_join_the_calling_turn_with_resolved_names() {
        let mut t = Transcript::new(vec![
            text(Role::System, "mid-conversation note"),
            text(Role::User, "fix it"),
            Message::new(
                Role::Assistant,
                vec![
                    Part::Text("looking".into()),
                    call("c1", "read", "{\"path\":\"a.rs\"}"),
                ],
            ),
            Message::tool_result(Some("c1".into()), "fn main() {}"),
        ]);
        t.resolve_tool_names();
        let entries = to_entries(&t.messages);
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].role, EntryRole::User);
        assert_eq!(
            entries[2].parts[2],
            EntryPart::ToolResult {
                name: "read".into(),
                output: "fn main() {}".into(),
                is_error: false
            }
        );
    }

    #[test]
    fn tool_result_parts_join_the_calling_turn_and_the_rest_stays_the_users() {
        use crate::transcript::ToolResult;
        let mut t = Transcript::new(vec![
            Message::new(Role::Assistant, vec![call("t1", "Read", "{}")]),
            Message::new(
                Role::User,
                vec![
                    Part::ToolResult(ToolResult {
                        call_id: Some("t1".into()),
                        name: None,
                        content: vec![Part::Text("line".into()), Part::Image],
                        is_error: true,
                    }),
                    Part::Text("please continue".into()),
                ],
            ),
        ]);
        t.resolve_tool_names();
        let entries = to_entries(&t.messages);
        assert_eq!(entries.len(), 2);
        assert_eq!(
            entries[0].parts[1],
            EntryPart::ToolResult {
                name: "Read".into(),
                output: "line\n[image]".into(),
                is_error: true
            }
        );
        assert_eq!(entries[1].role, EntryRole::User);
        assert_eq!(
            entries[1].parts,
            vec![EntryPart::Text {
                text: "please continue".into()
            }]
        );
    }

    fn sample_entries() -> Vec<Entry> {
        vec![
            Entry {
                role: EntryRole::User,
                parts: vec![EntryPart::Text {
                    text: "Fix the bug".into(),
                }],
            },
            Entry {
                role: EntryRole::Assistant,
                parts: vec![
                    EntryPart::Text {
                        text: "On it".into(),
                    },
                    EntryPart::ToolCall {
                        name: "bash".into(),
                        arguments: "{\"command\":\"ls\"}".into(),
                    },
                    EntryPart::ToolResult {
                        name: "bash".into(),
                        output: "src".into(),
                        is_error: false,
                    },
                    EntryPart::Reasoning {
                        text: "think".into(),
                    },
                ],
            },
        ]
    }

    #[test]
    fn layout_is_task_conversation_files() {
        let read = vec!["/a.go".to_string()];
        let modified = vec!["/b.go".to_string()];
        let input = PromptInput {
            prior_summary: Some("Earlier: did X"),
            read_files: &read,
            modified_files: &modified,
            instructions: Some("focus on the API"),
        };
        let built = build_prompt(&input, sample_entries(), 100_000, &LazyEstimator::default())
            .expect("fits");
        let p = &built.prompt;
        let order = [
            "<task>\n",
            "1. Primary Request and Intent — ",
            "9. Optional Next Step — ",
            "focus on the API",
            "</task>",
            "<conversation>\n<prior-summary>\nEarlier: did X\n</prior-summary>",
            "<user>\nFix the bug\n</user>",
            "<assistant>\nOn it\n[tool_call: bash({\"command\":\"ls\"})]\n\
             [tool_result: bash = src]\n[reasoning: think]\n</assistant>",
            "</conversation>",
            "<read-files>\n/a.go\n</read-files>",
            "<modified-files>\n/b.go\n</modified-files>",
        ];
        let mut at = 0;
        for piece in order {
            let found = p[at..]
                .find(piece)
                .unwrap_or_else(|| panic!("{piece:?} in\n{p}"));
            at += found + piece.len();
        }
        assert_eq!(built.omitted, 0);
        assert!(!p.contains("omitted"));
    }

    #[test]
    fn no_prior_summary_no_block() {
        let input = PromptInput::default();
        let built = build_prompt(&input, sample_entries(), 100_000, &LazyEstimator::default())
            .expect("fits");
        assert!(!built.prompt.contains("<prior-summary>\n"));
        assert!(!built.prompt.contains("Focus instructions"));
        assert!(built.prompt.contains("<read-files>\n</read-files>"));
    }

    #[test]
    fn oldest_turns_are_dropped_to_fit_and_the_prompt_says_so() {
        let input = PromptInput::default();
        let e = LazyEstimator::default();
        let entries: Vec<Entry> = (0..50)
            .map(|i| Entry {
                role: EntryRole::User,
                parts: vec![EntryPart::Text {
                    text: format!("turn {i} {}", "x".repeat(400)),
                }],
            })
            .collect();
        let smallest = build_prompt(&input, vec![], 100_000, &e).expect("fits");
        let limit = e.text(&smallest.prompt) + 1_000;
        let built = build_prompt(&input, entries.clone(), limit, &e).expect("fits");
        assert!(built.omitted > 0 && built.omitted < 50);
        assert!(e.text(&built.prompt) <= limit);
        assert_eq!(built.entries.len(), 50 - built.omitted);
        assert_eq!(built.entries[..], entries[built.omitted..]);
        assert!(built.prompt.contains(&omission_notice(built.omitted)));
        assert!(built.prompt.contains("turn 49 "), "the newest turn is kept");
        assert!(!built.prompt.contains("turn 0 "));
        let err = build_prompt(&input, entries, 10, &e).expect_err("cannot fit");
        assert!(matches!(err, PromptError::TooLarge { limit: 10, .. }));
    }

    #[test]
    fn the_models_turns_are_left_out_before_the_persons() {
        let input = PromptInput::default();
        let e = LazyEstimator::default();
        let turn = |role, i: usize| Entry {
            role,
            parts: vec![EntryPart::Text {
                text: format!("{role:?} {i} {}", "x".repeat(400)),
            }],
        };
        let entries: Vec<Entry> = (0..20)
            .flat_map(|i| [turn(EntryRole::User, i), turn(EntryRole::Assistant, i)])
            .collect();
        let smallest = build_prompt(&input, vec![], 100_000, &e).expect("fits");
        // Room for about 25 of the 40 turns: every user turn and the newest assistant turns.
        let limit = e.text(&smallest.prompt) + 25 * 110;
        let built = build_prompt(&input, entries, limit, &e).expect("fits");
        assert!(e.text(&built.prompt) <= limit);
        assert!(
            built.omitted >= 10 && built.omitted < 20,
            "{}",
            built.omitted
        );
        for i in 0..20 {
            assert!(
                built.prompt.contains(&format!("User {i} ")),
                "user turn {i} kept"
            );
        }
        assert!(
            built.prompt.contains("Assistant 19 "),
            "the newest assistant turn is kept"
        );
        assert!(!built.prompt.contains("Assistant 0 "));
        assert_eq!(built.entries.len(), 40 - built.omitted);
        assert!(
            built
                .entries
                .iter()
                .filter(|e| e.role == EntryRole::User)
                .count()
                == 20
        );
    }

    #[test]
    fn summary_message_introduces_the_summary_and_lists_files() {
        let m = summary_message("  the summary \n", &["a.rs".into()], &[]);
        assert!(m.starts_with(SUMMARY_INTRO));
        assert!(m.contains("\n\nthe summary\n\nFiles read so far:\n- a.rs"));
        assert!(!m.contains("modified"));
    }
}
