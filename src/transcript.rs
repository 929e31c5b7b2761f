//! The neutral transcript: what every dialect parses a chat request into.
//!
//! A [`Transcript`] is the request's message list in order, each [`Message`] a role, its parts
//! (text, image, tool call, tool result, reasoning, opaque) and, for tool-role messages, the
//! id and name of the call they answer. Tool results come in two shapes: a whole message of
//! role [`Role::Tool`] (Chat Completions `tool` messages, Responses `function_call_output`
//! items), or [`Part::ToolResult`] parts inside a user message (Anthropic `tool_result`
//! blocks, several per message when the model made parallel calls). It carries the
//! per-message token estimate computed by the dialect, and answers the structural questions
//! the engine asks: how long the head that is never compacted is, where the latest user message
//! is, which assistant message holds the calls each message answers, and where the assistant
//! turn a message belongs to starts. It never holds wire JSON: writing back is the dialect's
//! job.

use std::collections::HashMap;

use crate::estimate::{text_weight, Counts, LazyEstimator};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Instructions from the application (`system` or `developer`).
    System,
    /// The human or the agent's harness.
    User,
    /// The model.
    Assistant,
    /// A tool's output (`tool`, or the legacy `function` role).
    Tool,
}

/// A tool invocation by the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The call id (`None` for legacy `function_call`).
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// The arguments as sent (usually a JSON document in a string).
    pub arguments: String,
}

/// The output of a tool call carried as a part of a message (Anthropic `tool_result`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// The id of the call answered (`tool_use_id`).
    pub call_id: Option<String>,
    /// The tool's name, resolved from the call (see [`Transcript::resolve_tool_names`]).
    pub name: Option<String>,
    /// The output, in order (text, images, opaque parts).
    pub content: Vec<Part>,
    /// Whether the tool reported an error.
    pub is_error: bool,
}

/// One piece of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Plain text (including refusals).
    Text(String),
    /// An image (its URL or data is not kept).
    Image,
    /// A tool invocation.
    ToolCall(ToolCall),
    /// A tool's output inside a message (Anthropic `tool_result` blocks).
    ToolResult(ToolResult),
    /// Visible reasoning.
    Reasoning(String),
    /// Anything else (audio, files, unknown part types): its type and the weight of what the
    /// model reads of it.
    Opaque {
        /// The part's type, e.g. `input_audio`.
        kind: String,
        /// Text weight counted for the estimate ([`crate::estimate::text_weight`]).
        weight: usize,
    },
}

impl Part {
    /// Whether this part is the model's reasoning: visible text, or an encrypted or redacted
    /// form of it (`redacted_thinking`, a reasoning object).
    pub fn is_reasoning(&self) -> bool {
        match self {
            Part::Reasoning(_) => true,
            Part::Opaque { kind, .. } => {
                matches!(
                    kind.as_str(),
                    "redacted_thinking" | "reasoning" | "thinking"
                )
            }
            _ => false,
        }
    }

    /// Whether this part is a provider's own summary of the conversation before it, sealed
    /// (an OpenAI Responses `compaction` item, its history in `encrypted_content`): compactor
    /// cannot read it into a summary of its own, so it is never compacted.
    pub fn is_provider_summary(&self) -> bool {
        matches!(self, Part::Opaque { kind, .. } if kind == PROVIDER_SUMMARY_KIND)
    }
}

/// The type of a provider's sealed summary item or block ([`Part::is_provider_summary`]).
pub const PROVIDER_SUMMARY_KIND: &str = "compaction";

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its author.
    pub role: Role,
    /// Its content, in order.
    pub parts: Vec<Part>,
    /// For tool results: the id of the call answered (`None` for legacy `function` results).
    pub tool_call_id: Option<String>,
    /// For tool results: the tool's name (given, or resolved from the call).
    pub tool_name: Option<String>,
    /// Estimated tokens of this message as the model reads it.
    pub tokens: usize,
}

impl Message {
    /// What the model reads of this message.
    pub fn counts(&self) -> Counts {
        parts_counts(&self.parts)
    }

    /// A message whose estimate is computed from its parts with the default estimator.
    pub fn new(role: Role, parts: Vec<Part>) -> Message {
        let mut m = Message {
            role,
            parts,
            tool_call_id: None,
            tool_name: None,
            tokens: 0,
        };
        m.tokens = LazyEstimator::default().counts(m.counts());
        m
    }

    /// A tool result answering `call_id` (estimate from its parts).
    pub fn tool_result(call_id: Option<String>, output: impl Into<String>) -> Message {
        let mut m = Message::new(Role::Tool, vec![Part::Text(output.into())]);
        m.tool_call_id = call_id;
        m
    }

    /// The tool calls this message makes.
    pub fn tool_calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.parts.iter().filter_map(|p| match p {
            Part::ToolCall(c) => Some(c),
            _ => None,
        })
    }

    /// The tool results this message carries as parts.
    pub fn tool_results(&self) -> impl Iterator<Item = &ToolResult> {
        self.parts.iter().filter_map(|p| match p {
            Part::ToolResult(r) => Some(r),
            _ => None,
        })
    }

    /// Whether this message answers tool calls: a tool-role message, or a message opening
    /// with tool-result parts (Anthropic's user message of `tool_result` blocks).
    pub fn is_tool_answer(&self) -> bool {
        self.role == Role::Tool || matches!(self.parts.first(), Some(Part::ToolResult(_)))
    }

    /// Whether the message is nothing but reasoning (a Responses `reasoning` item): it belongs
    /// with the output that follows it.
    pub fn is_reasoning_only(&self) -> bool {
        self.role == Role::Assistant
            && !self.parts.is_empty()
            && self.parts.iter().all(Part::is_reasoning)
    }

    /// Whether the message opens with reasoning (Anthropic: its first block is `thinking` or
    /// `redacted_thinking`).
    pub fn starts_with_reasoning(&self) -> bool {
        self.parts.first().is_some_and(Part::is_reasoning)
    }

    /// Whether any part is reasoning.
    pub fn has_reasoning(&self) -> bool {
        self.parts.iter().any(Part::is_reasoning)
    }

    /// Cuts the text of its tool outputs (a tool-role message's parts, the content of its
    /// tool-result parts) to at most `chars` characters each, freeing the rest. For a
    /// transcript read only to be summarised, whose prompt shows the start of each output and
    /// no more: the outputs are most of an agent's request, and holding them whole beside the
    /// request's own bytes held that request twice over.
    pub fn cut_outputs(&mut self, chars: usize) {
        if self.role == Role::Tool {
            cut_texts(&mut self.parts, chars);
            return;
        }
        for part in &mut self.parts {
            if let Part::ToolResult(result) = part {
                cut_texts(&mut result.content, chars);
            }
        }
    }

    /// Its text parts joined by newlines (the output of a tool result).
    pub fn text(&self) -> String {
        let mut out = String::new();
        for part in &self.parts {
            if let Part::Text(t) = part {
                if !out.is_empty() {
                    out.push('\n');
                }
                out.push_str(t);
            }
        }
        out
    }
}

/// A parsed conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transcript {
    /// The messages, oldest first.
    pub messages: Vec<Message>,
    /// How many leading messages are the kept head (see [`Transcript::head_len`]).
    head: usize,
    /// The head without the opening (see [`Transcript::head_len_without_opening`]).
    base_head: usize,
}

impl Transcript {
    /// Wraps messages; the head is their leading system/developer messages, and everything up
    /// to the last provider summary ([`Part::is_provider_summary`]): a sealed summary stands
    /// for the history before it, which compactor cannot fold into its own summary, so it and
    /// what precedes it are kept as sent.
    pub fn new(messages: Vec<Message>) -> Transcript {
        let leading = messages
            .iter()
            .take_while(|m| m.role == Role::System)
            .count();
        let sealed = messages
            .iter()
            .rposition(|m| m.parts.iter().any(Part::is_provider_summary))
            .map_or(0, |i| i + 1);
        let head = leading.max(sealed);
        Transcript {
            messages,
            head,
            base_head: head,
        }
    }

    /// This transcript with its opening in the head, when the opening is at most `budget`
    /// estimated tokens. The opening is what the client sent before the model's first reply,
    /// after the leading system messages: agents put their project instructions there (Claude
    /// Code's CLAUDE.md as `<system-reminder>` blocks in the first user message, Codex's
    /// AGENTS.md and environment context as user messages), and the task itself, and never
    /// send them again. Summarised, they would live on only as far as the summarizer copies
    /// them; in the head they reach the model verbatim on every request. A conversation with
    /// no reply yet has no opening, and one longer than `budget` is compacted like any other
    /// turn, so a huge first message cannot stop compaction.
    pub fn keeping_opening(mut self, budget: usize) -> Transcript {
        let leading = self
            .messages
            .iter()
            .take_while(|m| m.role == Role::System)
            .count();
        let reply = self
            .messages
            .iter()
            .position(|m| m.role == Role::Assistant || m.is_tool_answer());
        if let Some(end) = reply.filter(|&i| self.messages[i].role == Role::Assistant) {
            let tokens = self.messages[leading.min(end)..end]
                .iter()
                .fold(0usize, |acc, m| acc.saturating_add(m.tokens));
            if tokens <= budget {
                self.head = self.head.max(end);
            }
        }
        self
    }

    /// This conversation without `messages[range]` (a prefix a stored summary stands in for),
    /// keeping this transcript's head. The head is not recomputed: a system message that
    /// followed the removed range is a message of the conversation to compact like any other,
    /// not part of the head, or it would be neither kept nor summarised.
    pub fn without(&self, range: std::ops::Range<usize>) -> Transcript {
        let n = self.messages.len();
        let (start, end) = (range.start.min(n), range.end.min(n));
        let messages = self.messages[..start]
            .iter()
            .chain(&self.messages[end.max(start)..])
            .cloned()
            .collect();
        Transcript {
            messages,
            head: self.head.min(start),
            base_head: self.base_head.min(start),
        }
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether there are no messages.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// How many leading messages are the head that is never compacted: the leading
    /// system/developer messages of the conversation as received, everything through its
    /// last provider summary ([`Transcript::new`]), and the opening when it was kept
    /// ([`Transcript::keeping_opening`]).
    pub fn head_len(&self) -> usize {
        self.head.min(self.messages.len())
    }

    /// The head without the conversation's opening: what stays never compacted when keeping
    /// the opening verbatim would leave no way under the trigger (the engine decides).
    pub fn head_len_without_opening(&self) -> usize {
        self.base_head.min(self.messages.len())
    }

    /// Index of the latest user message, if any; user messages that only carry tool results
    /// (Anthropic `tool_result` blocks) continue the assistant's turn and do not count.
    pub fn last_user(&self) -> Option<usize> {
        self.messages
            .iter()
            .rposition(|m| m.role == Role::User && !m.is_tool_answer())
    }

    /// Index of the first message of the assistant turn message `i` belongs to: the turn
    /// starts after the latest user or system message before `i` that is not a tool answer,
    /// and runs through the model's messages and the tool results it receives. A message that
    /// is itself a user or system message (not a tool answer) starts its own turn, except a
    /// user message continuing a run of user messages that holds a tool answer: the Anthropic
    /// API merges consecutive user messages, so such a message (a reminder sent after the tool
    /// results) is part of the answer.
    pub fn turn_start(&self, i: usize) -> usize {
        let messages = &self.messages;
        let opens_turn = |j: usize| {
            let m = &messages[j];
            let joins_answer = m.role == Role::User
                && messages[..j]
                    .iter()
                    .rev()
                    .take_while(|p| p.role == Role::User)
                    .any(Message::is_tool_answer);
            matches!(m.role, Role::User | Role::System) && !m.is_tool_answer() && !joins_answer
        };
        if i >= messages.len() || opens_turn(i) {
            return i;
        }
        (0..i).rev().find(|&j| opens_turn(j)).map_or(0, |u| u + 1)
    }

    /// The messages of `range` (clamped) as the message-count trigger counts them: a run of
    /// the model's own messages is one (in Responses its reasoning, calls and message are
    /// separate items; Chat Completions carries them in one assistant message), as the scan of
    /// the raw request counts them.
    pub fn counted(&self, range: std::ops::Range<usize>) -> usize {
        let end = range.end.min(self.messages.len());
        let start = range.start.min(end);
        let slice = &self.messages[start..end];
        let model = |m: &Message| m.role == Role::Assistant;
        slice.len()
            - slice
                .windows(2)
                .filter(|pair| model(&pair[0]) && model(&pair[1]))
                .count()
    }

    /// Sum of the estimates of `messages[range]`.
    pub fn tokens(&self, range: std::ops::Range<usize>) -> usize {
        self.messages
            .get(range)
            .unwrap_or_default()
            .iter()
            .fold(0usize, |acc, m| acc.saturating_add(m.tokens))
    }

    /// For each message: when it is a tool result, the index of the assistant message that
    /// holds the call it answers (the nearest earlier one with that call id; for legacy
    /// `function` results, the nearest earlier assistant with a legacy call); when it carries
    /// tool-result parts, the earliest of the assistant messages holding the calls they
    /// answer; otherwise, or when no such call exists, `None`.
    pub fn pairs(&self) -> Vec<Option<usize>> {
        let mut by_id: HashMap<&str, usize> = HashMap::new();
        let mut legacy: Option<usize> = None;
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            match m.role {
                Role::Assistant => {
                    for call in m.tool_calls() {
                        match &call.id {
                            Some(id) => {
                                by_id.insert(id.as_str(), i);
                            }
                            None => legacy = Some(i),
                        }
                    }
                    out.push(None);
                }
                Role::Tool => out.push(match &m.tool_call_id {
                    Some(id) => by_id.get(id.as_str()).copied(),
                    None => legacy,
                }),
                _ => out.push(
                    m.tool_results()
                        .filter_map(|r| by_id.get(r.call_id.as_deref()?).copied())
                        .min(),
                ),
            }
        }
        out
    }

    /// Fills in `tool_name` of tool results (and the name of tool-result parts) from the calls
    /// they answer, where missing.
    pub fn resolve_tool_names(&mut self) {
        self.resolve_tool_name_parts();
        let pairs = self.pairs();
        for (i, pair) in pairs.into_iter().enumerate() {
            let Some(a) = pair else { continue };
            let Some(message) = self.messages.get(i) else {
                continue;
            };
            if message.tool_name.is_some() {
                continue;
            }
            let id = message.tool_call_id.clone();
            let name = self.messages.get(a).and_then(|assistant| {
                assistant
                    .tool_calls()
                    .filter(|c| c.id == id)
                    .last()
                    .map(|c| c.name.clone())
            });
            if let Some(message) = self.messages.get_mut(i) {
                message.tool_name = name;
            }
        }
    }

    /// Names tool-result parts after the nearest earlier call with their id.
    fn resolve_tool_name_parts(&mut self) {
        let mut names: HashMap<String, String> = HashMap::new();
        for m in &mut self.messages {
            for part in &mut m.parts {
                match part {
                    Part::ToolCall(ToolCall {
                        id: Some(id), name, ..
                    }) => {
                        names.insert(id.clone(), name.clone());
                    }
                    Part::ToolResult(r) if r.name.is_none() => {
                        r.name = r.call_id.as_ref().and_then(|id| names.get(id)).cloned();
                    }
                    _ => {}
                }
            }
        }
    }
}

/// What the model reads of a list of parts (tool-result parts: their content: Anthropic
/// carries a tool result as a part).
pub fn parts_counts(parts: &[Part]) -> Counts {
    let mut counts = Counts::default();
    for part in parts {
        match part {
            Part::Text(text) | Part::Reasoning(text) => {
                counts.text = counts.text.saturating_add(text_weight(text))
            }
            Part::Image => counts.images = counts.images.saturating_add(1),
            Part::ToolCall(call) => {
                counts.text = counts
                    .text
                    .saturating_add(text_weight(&call.name) + text_weight(&call.arguments))
            }
            Part::ToolResult(result) => counts.add(parts_counts(&result.content)),
            Part::Opaque { weight, .. } => counts.text = counts.text.saturating_add(*weight),
        }
    }
    counts
}

/// Cuts every text in `parts` (nested tool results' included) to at most `chars` characters,
/// returning what it frees to the allocator ([`Message::cut_outputs`]).
fn cut_texts(parts: &mut [Part], chars: usize) {
    for part in parts {
        match part {
            // No longer in characters than in bytes: nothing to search.
            Part::Text(text) | Part::Reasoning(text) if text.len() > chars => {
                if let Some((cut, _)) = text.char_indices().nth(chars) {
                    // A copy, then the whole text freed: shrunk in place, its freed end would
                    // be too short for the next output read, and the heap would grow by each.
                    *text = text[..cut].to_string();
                }
            }
            Part::ToolResult(result) => cut_texts(&mut result.content, chars),
            _ => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn call(id: &str, name: &str, args: &str) -> Part {
        Part::ToolCall(ToolCall {
            id: Some(id.into()),
            name: name.into(),
            arguments: args.into(),
        })
    }

    pub(crate) fn text(role: Role, t: &str) -> Message {
        Message::new(role, vec![Part::Text(t.into())])
    }

    #[test]
    fn head_and_last_user() {
        let t = Transcript::new(vec![
            text(Role::System, "s"),
            text(Role::System, "d"),
            text(Role::User, "u"),
            text(Role::System, "mid"),
            text(Role::User, "u2"),
            text(Role::Assistant, "a"),
        ]);
        assert_eq!(t.head_len(), 2);
        assert_eq!(t.last_user(), Some(4));
        assert_eq!(Transcript::default().head_len(), 0);
        assert_eq!(Transcript::default().last_user(), None);
    }

    /// `text` with an estimate of `tokens`.
    fn costing(role: Role, t: &str, tokens: usize) -> Message {
        let mut m = text(role, t);
        m.tokens = tokens;
        m
    }

    #[test]
    fn the_opening_joins_the_head_when_it_fits_its_budget() {
        // Codex: developer instructions, AGENTS.md, environment, the task; then the model.
        let codex = || {
            Transcript::new(vec![
                costing(Role::System, "permissions", 50),
                costing(Role::User, "# AGENTS.md RULE-PURPLE", 30),
                costing(Role::User, "<environment_context>", 20),
                costing(Role::System, "a developer note between them", 10),
                costing(Role::User, "fix the parser", 5),
                costing(Role::Assistant, "reasoning", 5),
                costing(Role::User, "thanks", 1),
            ])
        };
        assert_eq!(codex().head_len(), 1, "no opening without a budget");
        // The system head is not the opening's: 30 + 20 + 10 + 5 tokens.
        assert_eq!(codex().keeping_opening(65).head_len(), 5);
        assert_eq!(
            codex().keeping_opening(64).head_len(),
            1,
            "too long to keep"
        );
        // The head survives removing a later range.
        assert_eq!(codex().keeping_opening(65).without(5..6).head_len(), 5);

        // No reply yet: nothing tells the opening from the conversation.
        let unanswered = Transcript::new(vec![text(Role::User, "a"), text(Role::User, "b")]);
        assert_eq!(unanswered.keeping_opening(usize::MAX).head_len(), 0);
        // A tool answer before any reply is no opening either.
        let odd = Transcript::new(vec![
            text(Role::User, "a"),
            text(Role::Tool, "out"),
            text(Role::Assistant, "b"),
        ]);
        assert_eq!(odd.keeping_opening(usize::MAX).head_len(), 0);
        // A provider's sealed summary later in the conversation still ends the head.
        let sealed = Transcript::new(vec![
            text(Role::User, "task"),
            text(Role::Assistant, "a"),
            Message::new(
                Role::Assistant,
                vec![Part::Opaque {
                    kind: PROVIDER_SUMMARY_KIND.into(),
                    weight: 1,
                }],
            ),
            text(Role::User, "next"),
        ]);
        assert_eq!(sealed.head_len(), 3);
        assert_eq!(sealed.keeping_opening(usize::MAX).head_len(), 3);
    }

    #[test]
    fn tool_results_pair_with_the_nearest_call_holding_their_id() {
        // Reused ids (as in the marshmallow fixture) pair with the latest call.
        let t = Transcript::new(vec![
            text(Role::User, "go"),
            Message::new(
                Role::Assistant,
                vec![call("c1", "bash", "{}"), call("c2", "read", "{}")],
            ),
            Message::tool_result(Some("c2".into()), "two"),
            Message::tool_result(Some("c1".into()), "one"),
            Message::new(Role::Assistant, vec![call("c1", "edit", "{}")]),
            Message::tool_result(Some("c1".into()), "again"),
            Message::tool_result(Some("zz".into()), "orphan"),
        ]);
        assert_eq!(
            t.pairs(),
            vec![None, None, Some(1), Some(1), None, Some(4), None]
        );
        let mut t = t;
        t.resolve_tool_names();
        let names: Vec<_> = t.messages.iter().map(|m| m.tool_name.as_deref()).collect();
        assert_eq!(
            names,
            vec![
                None,
                None,
                Some("read"),
                Some("bash"),
                None,
                Some("edit"),
                None
            ]
        );
    }

    #[test]
    fn legacy_function_results_pair_with_the_latest_function_call() {
        let legacy = Part::ToolCall(ToolCall {
            id: None,
            name: "get_weather".into(),
            arguments: "{}".into(),
        });
        let mut t = Transcript::new(vec![
            text(Role::User, "weather?"),
            Message::new(Role::Assistant, vec![legacy]),
            Message::tool_result(None, "sunny"),
        ]);
        assert_eq!(t.pairs(), vec![None, None, Some(1)]);
        t.resolve_tool_names();
        assert_eq!(t.messages[2].tool_name.as_deref(), Some("get_weather"));
    }

    fn result_part(id: &str) -> Part {
        Part::ToolResult(ToolResult {
            call_id: Some(id.into()),
            name: None,
            content: vec![Part::Text("out".into())],
            is_error: false,
        })
    }

    #[test]
    fn tool_result_parts_pair_resolve_and_do_not_make_a_user_turn() {
        let mut t = Transcript::new(vec![
            text(Role::User, "go"),
            Message::new(
                Role::Assistant,
                vec![call("a", "Read", "{}"), call("b", "Bash", "{}")],
            ),
            Message::new(
                Role::User,
                vec![
                    result_part("b"),
                    result_part("a"),
                    Part::Text("note".into()),
                ],
            ),
            text(Role::Assistant, "ok"),
            Message::new(Role::User, vec![result_part("zz")]),
        ]);
        assert_eq!(t.pairs(), vec![None, None, Some(1), None, None]);
        assert_eq!(
            t.last_user(),
            Some(0),
            "tool answers are not the user's turn"
        );
        assert!(t.messages[2].is_tool_answer() && t.messages[4].is_tool_answer());
        assert_eq!(t.turn_start(3), 1);
        assert_eq!(t.turn_start(0), 0);
        // A reminder sent as its own user message after the results joins them (the API merges
        // consecutive user messages): it opens no turn. After the model's answer it would.
        let reminded = Transcript::new(vec![
            text(Role::User, "go"),
            Message::new(Role::Assistant, vec![call("a", "Read", "{}")]),
            Message::new(Role::User, vec![result_part("a")]),
            text(Role::User, "<system-reminder>r</system-reminder>"),
            Message::new(Role::Assistant, vec![call("b", "Bash", "{}")]),
            text(Role::User, "next task"),
            text(Role::Assistant, "ok"),
        ]);
        assert_eq!(reminded.turn_start(4), 1);
        assert_eq!(reminded.turn_start(3), 1);
        assert_eq!(reminded.turn_start(6), 6);
        assert_eq!(reminded.turn_start(5), 5);
        t.resolve_tool_names();
        let names: Vec<_> = t.messages[2]
            .tool_results()
            .map(|r| r.name.as_deref())
            .collect();
        assert_eq!(names, vec![Some("Bash"), Some("Read")]);
        assert_eq!(
            t.messages[4]
                .tool_results()
                .next()
                .and_then(|r| r.name.as_deref()),
            None
        );
        // A tool result's content counts toward the estimate.
        assert_eq!(
            t.messages[2].tokens,
            LazyEstimator::default().text("outoutnote")
        );
    }

    #[test]
    fn reasoning_shapes() {
        let r = Message::new(Role::Assistant, vec![Part::Reasoning("x".into())]);
        assert!(r.is_reasoning_only() && r.starts_with_reasoning());
        let redacted = Message::new(
            Role::Assistant,
            vec![
                Part::Opaque {
                    kind: "redacted_thinking".into(),
                    weight: 8,
                },
                call("a", "bash", "{}"),
            ],
        );
        assert!(redacted.starts_with_reasoning() && !redacted.is_reasoning_only());
        assert!(!text(Role::Assistant, "x").has_reasoning());
        assert!(!Message::new(Role::Assistant, vec![]).is_reasoning_only());
    }

    #[test]
    fn tokens_sum_and_text_join() {
        let t = Transcript::new(vec![text(Role::User, "abcd"), text(Role::User, "abcdefgh")]);
        assert_eq!(t.tokens(0..2), 3);
        assert_eq!(t.tokens(5..9), 0, "out of range is empty, not a panic");
        let m = Message::new(
            Role::Tool,
            vec![Part::Text("a".into()), Part::Image, Part::Text("b".into())],
        );
        assert_eq!(m.text(), "a\nb");
    }

    #[test]
    fn everything_the_model_reads_counts() {
        let m = Message::new(
            Role::Assistant,
            vec![
                Part::Text("abcd".into()),
                Part::Reasoning("efgh".into()),
                Part::ToolCall(ToolCall {
                    id: Some("call_1".into()),
                    name: "bash".into(),
                    arguments: "{\"c\":1}".into(),
                }),
                Part::Image,
                Part::Opaque {
                    kind: "input_audio".into(),
                    weight: 80,
                },
            ],
        );
        assert_eq!(
            m.counts(),
            Counts {
                text: text_weight("abcdefghbash{\"c\":1}") + 80,
                images: 1
            }
        );
        // 13 letters, 5 symbols, a digit and the opaque part's 80: 6.55 tokens.
        assert_eq!(LazyEstimator::default().counts(m.counts()), 7 + 765);
    }
}
