//! The preserve boundary: which recent messages stay verbatim (docs/architecture.md,
//! *Preserve boundary*).
//!
//! The preserve budget is `preserve_ratio × usable window`, clamped to
//! [`min_preserve_tokens`, `max_preserve_tokens`] (2,000 and 15,000 by default), where the
//! usable window is the model's context window minus the output the request reserves: the
//! tail competes with the rest of the input for that space, not with the output.
//!
//! [`find_preserve_boundary`] walks from the newest message to the oldest, keeping messages
//! while they fit the budget (and at most `max_messages` of them), then adjusts:
//! 1. the last message is always kept (it is the turn being answered), and at least the
//!    oldest compactable message is compacted (a budget larger than the conversation must not
//!    turn a due compaction into a no-op);
//! 2. the latest user message is kept when the tail from it stays within the caller's
//!    allowance (the engine allows what keeps the rewrite at or below half of each trigger,
//!    so it does not trip again right away) and something before it remains to compact. In a
//!    long agentic turn (one task message followed by hundreds of tool calls) keeping it is
//!    impossible; the summary then carries every user message (section 6 of the prompt) and
//!    pins the latest one verbatim;
//! 3. a tool call is never separated from its result: the tail never starts on a tool answer
//!    (a tool-role message, or a user message opening with tool-result parts: Anthropic only
//!    accepts `tool_result` blocks right after the message holding their `tool_use`), and when
//!    a tool result anywhere in the tail answers a call made before the boundary, the boundary
//!    moves back to that assistant message (a user message answering several parallel calls
//!    pulls in the earliest);
//! 4. reasoning stays with what it reasoned about: a message that is nothing but reasoning (a
//!    Responses `reasoning` item) opens a model response, and the tail never starts on a later
//!    message of that response (the run of consecutive assistant messages after it: the
//!    Responses API refuses a `function_call` or output message without the `reasoning` item
//!    produced with it); and inside an Anthropic tool loop (an assistant message right
//!    after a user message of `tool_result` blocks) whose turn carries thinking, the tail
//!    starts only on an assistant message that opens with its own thinking, else at the start
//!    of the turn: with thinking enabled, Anthropic requires the assistant message that opens
//!    the final turn to start with a thinking block;
//! 5. parallel calls stay together: the tail never starts on a tool call right after another
//!    assistant message that is one (a Responses response's `function_call` items, whose
//!    results may come later and in any order).
//!
//! The rules only ever move the boundary back (a longer tail), so they are applied until none
//! moves it.
//! The head (leading system/developer messages, and everything through a provider's sealed
//! summary: `Transcript::head_len`) is never compacted; when no message is left between it and
//! the boundary there is nothing to compact.

use crate::config::CompactionConfig;
use crate::transcript::{Role, Transcript};

/// Floor of the preserve budget: enough recent work for the model to carry on.
pub const MIN_PRESERVE_RECENT_TOKENS: usize = 2_000;

/// Ceiling of the preserve budget: a compaction must still remove something worth it.
pub const MAX_PRESERVE_RECENT_TOKENS: usize = 15_000;

/// `preserve_ratio × usable_window`, clamped to the configured min and max preserve tokens.
pub fn preserve_budget(config: &CompactionConfig, usable_window: usize) -> usize {
    // `as` saturates: NaN and negatives become 0, overflow `usize::MAX`.
    let scaled = (config.preserve_ratio * usable_window as f64).floor() as usize;
    // Not `clamp`: it panics when min > max, which validation forbids but this must not trust.
    scaled
        .max(config.min_preserve_tokens)
        .min(config.max_preserve_tokens)
}

/// What the preserved tail may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailLimits {
    /// Token budget of the walk.
    pub budget: usize,
    /// Most messages the walk keeps.
    pub max_messages: usize,
    /// Keep the latest user message only if the tail from it is at most this many tokens...
    pub turn_max_tokens: usize,
    /// ...and at most this many messages.
    pub turn_max_messages: usize,
}

/// The index where the preserved tail starts, or `None` when nothing can be compacted.
///
/// The result `b` satisfies `head < b < len`: messages `head..b` are compacted, `b..` kept.
pub fn find_preserve_boundary(t: &Transcript, limits: &TailLimits) -> Option<usize> {
    find_preserve_boundary_after(t, t.head_len(), limits)
}

/// [`find_preserve_boundary`] after a head of `head` messages instead of the transcript's
/// own (the head without the opening, when keeping the opening cannot fit).
pub fn find_preserve_boundary_after(
    t: &Transcript,
    head: usize,
    limits: &TailLimits,
) -> Option<usize> {
    let n = t.len();
    if n < head + 2 {
        return None;
    }
    let messages = &t.messages;

    // Walk newest → oldest within the budget.
    let mut b = n;
    let mut spent = 0usize;
    for (i, m) in messages.iter().enumerate().skip(head).rev() {
        if n - i > limits.max_messages {
            break;
        }
        match spent.checked_add(m.tokens) {
            Some(s) if s <= limits.budget => {
                spent = s;
                b = i;
            }
            _ => break,
        }
    }
    // Always keep the last message; compact at least one message (the trigger fired, so a
    // budget that covers everything still has to give way).
    b = b.min(n - 1).max(head + 1);

    // Keep the latest user turn when affordable and when it leaves something to compact.
    if let Some(u) = t.last_user() {
        if u > head
            && u < b
            && n - u <= limits.turn_max_messages
            && t.tokens(u..n) <= limits.turn_max_tokens
        {
            b = u;
        }
    }

    // Keep tool calls with their results, and reasoning with its output.
    let pairs = t.pairs();
    // suffix_min[j] = the earliest assistant index answered by a tool result at j or later.
    let mut suffix_min = vec![usize::MAX; n + 1];
    for j in (0..n).rev() {
        let here = pairs.get(j).copied().flatten().unwrap_or(usize::MAX);
        suffix_min[j] = here.min(suffix_min[j + 1]);
    }
    while b > head {
        let moved = if messages[b].is_tool_answer() {
            match pairs.get(b).copied().flatten() {
                Some(a) if a < b => a,
                _ => b - 1,
            }
        } else if suffix_min.get(b).is_some_and(|&a| a < b) {
            suffix_min[b]
        } else if let Some(r) = response_start(t, b) {
            r
        } else if let Some(c) = parallel_calls_start(t, b) {
            c
        } else {
            thinking_loop_start(t, b).unwrap_or(b)
        };
        if moved == b {
            break;
        }
        b = moved;
    }

    (b > head).then_some(b)
}

/// Where a tail starting at assistant message `b` must start instead because a message
/// earlier in the same run of assistant messages opened the response `b` belongs to with
/// reasoning: a Responses reasoning item, or an Anthropic assistant message opening with
/// thinking (the API merges consecutive assistant messages into one turn, which must then
/// still open with its thinking).
fn response_start(t: &Transcript, b: usize) -> Option<usize> {
    let messages = &t.messages;
    if messages.get(b)?.role != Role::Assistant {
        return None;
    }
    messages[..b]
        .iter()
        .rev()
        .take_while(|m| m.role == Role::Assistant)
        .position(|m| m.is_reasoning_only() || m.starts_with_reasoning())
        .map(|back| b - 1 - back)
}

/// Where a tail starting at assistant message `b`, a tool call, must start instead because the
/// assistant messages right before it are tool calls too: one response's parallel calls (a
/// Responses response's `function_call` items). Their results may come in any order, and not
/// yet at all when the request ends on the calls: a boundary between them would leave a later
/// request with a result whose call was summarised.
fn parallel_calls_start(t: &Transcript, b: usize) -> Option<usize> {
    let messages = &t.messages;
    let calls =
        |i: usize| messages[i].role == Role::Assistant && messages[i].tool_calls().next().is_some();
    if !calls(b) {
        return None;
    }
    let run = (0..b).rev().take_while(|&i| calls(i)).count();
    (run > 0).then(|| b - run)
}

/// Where a tail starting at `b` must start instead because `b` is inside an Anthropic tool loop
/// whose turn carries thinking while `b` does not open with thinking: the latest earlier
/// assistant message of the turn that opens with thinking, else the turn's first message.
/// `None` when `b` is not such a message.
///
/// The API merges consecutive user messages into one, so a run of them holding a tool result
/// answers tools as a whole: an assistant message after it continues the loop, and so does a
/// user message within it (its text joins the tool results), either way in the turn of the
/// assistant message before the run. Consecutive assistant messages are merged too, so an
/// assistant message continuing such a run is judged where the run starts.
fn thinking_loop_start(t: &Transcript, b: usize) -> Option<usize> {
    let messages = &t.messages;
    let b = if messages.get(b)?.role == Role::Assistant {
        messages[..b]
            .iter()
            .rposition(|m| m.role != Role::Assistant)
            .map_or(0, |i| i + 1)
    } else {
        b
    };
    let m = messages.get(b)?;
    let previous = messages.get(b.checked_sub(1)?)?;
    if previous.role != Role::User || m.starts_with_reasoning() {
        return None;
    }
    let run = messages[..b]
        .iter()
        .rposition(|m| m.role != Role::User)
        .map_or(0, |i| i + 1);
    let answers_tools = messages[run..b]
        .iter()
        .any(|m| m.tool_results().next().is_some());
    let in_tool_loop = answers_tools
        && match m.role {
            Role::Assistant => true,
            Role::User => !m.is_tool_answer(),
            _ => false,
        };
    if !in_tool_loop {
        return None;
    }
    let start = t.turn_start(run.checked_sub(1)?);
    let turn = messages.get(start..b)?;
    if !turn.iter().any(|m| m.has_reasoning()) {
        return None;
    }
    let opener = turn
        .iter()
        .rposition(|m| m.role == Role::Assistant && m.starts_with_reasoning())
        .map_or(start, |j| start + j);
    Some(opener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transcript::tests::{call, text};
    use crate::transcript::{Message, Part, ToolResult};

    fn sized(role: Role, tokens: usize) -> Message {
        let mut m = text(role, "x");
        m.tokens = tokens;
        m
    }

    fn wide() -> TailLimits {
        TailLimits {
            budget: 100,
            max_messages: usize::MAX,
            turn_max_tokens: usize::MAX,
            turn_max_messages: usize::MAX,
        }
    }

    #[test]
    fn preserve_constants_match_the_config_defaults() {
        assert_eq!(MIN_PRESERVE_RECENT_TOKENS, 2_000);
        assert_eq!(MAX_PRESERVE_RECENT_TOKENS, 15_000);
        let c = CompactionConfig::default();
        assert_eq!(c.min_preserve_tokens, MIN_PRESERVE_RECENT_TOKENS);
        assert_eq!(c.max_preserve_tokens, MAX_PRESERVE_RECENT_TOKENS);
    }

    #[test]
    fn budget_is_a_share_of_the_usable_window_clamped() {
        let c = CompactionConfig::default();
        assert_eq!(
            preserve_budget(&c, 128_000),
            15_000,
            "32,000 clamped to the max"
        );
        assert_eq!(preserve_budget(&c, 40_000), 10_000);
        assert_eq!(preserve_budget(&c, 4_000), 2_000, "1,000 raised to the min");
        let bad = CompactionConfig {
            min_preserve_tokens: 10,
            max_preserve_tokens: 5,
            ..c
        };
        assert_eq!(
            preserve_budget(&bad, 1_000),
            5,
            "inverted bounds do not panic"
        );
    }

    #[test]
    fn walks_newest_to_oldest_within_the_budget() {
        let t = Transcript::new(vec![
            sized(Role::System, 50),
            sized(Role::User, 40),
            sized(Role::Assistant, 40),
            sized(Role::User, 40),
            sized(Role::Assistant, 30),
            sized(Role::User, 30),
        ]);
        // 30 + 30 + 40 = 100 fits; the next 40 does not.
        assert_eq!(find_preserve_boundary(&t, &wide()), Some(3));
    }

    #[test]
    fn max_messages_caps_the_walk() {
        let t = Transcript::new((0..10).map(|_| sized(Role::User, 1)).collect());
        let limits = TailLimits {
            max_messages: 4,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(6));
    }

    #[test]
    fn the_last_message_is_kept_even_over_budget() {
        let t = Transcript::new(vec![
            sized(Role::User, 10),
            sized(Role::Assistant, 10),
            sized(Role::User, 500),
        ]);
        assert_eq!(find_preserve_boundary(&t, &wide()), Some(2));
    }

    #[test]
    fn the_latest_user_turn_is_kept_when_affordable() {
        let msgs = vec![
            sized(Role::User, 10),
            sized(Role::Assistant, 10),
            sized(Role::User, 10),
            sized(Role::Assistant, 60),
            sized(Role::Assistant, 60),
        ];
        let t = Transcript::new(msgs);
        // Budget alone keeps only the last message; the user turn (130 tokens) is affordable.
        let limits = TailLimits {
            turn_max_tokens: 130,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(2));
        // Not affordable: fall back to the budget.
        let limits = TailLimits {
            turn_max_tokens: 129,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(4));
        let limits = TailLimits {
            turn_max_messages: 2,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(4));
    }

    #[test]
    fn a_single_task_message_does_not_block_compaction() {
        // system, task, then a long agentic run: the user message is the first compactable
        // message, keeping it would leave nothing to compact.
        let mut msgs = vec![sized(Role::System, 5), sized(Role::User, 5)];
        for i in 0..10 {
            let id = format!("c{i}");
            let mut a = Message::new(Role::Assistant, vec![call(&id, "bash", "{}")]);
            a.tokens = 20;
            msgs.push(a);
            let mut r = Message::tool_result(Some(id), "out");
            r.tokens = 20;
            msgs.push(r);
        }
        let t = Transcript::new(msgs);
        let b = find_preserve_boundary(&t, &wide()).expect("something to compact");
        assert_eq!(
            b, 16,
            "budget 100 keeps two and a half pairs; moved back to a whole pair"
        );
        assert_eq!(t.messages[b].role, Role::Assistant);
    }

    #[test]
    fn tail_never_starts_on_a_tool_result_and_keeps_parallel_calls_whole() {
        let t = Transcript::new(vec![
            sized(Role::System, 1),
            sized(Role::User, 1),
            Message::new(
                Role::Assistant,
                vec![
                    call("a", "read", "{}"),
                    call("b", "read", "{}"),
                    call("c", "bash", "{}"),
                ],
            ),
            Message::tool_result(Some("c".into()), "3"),
            Message::tool_result(Some("a".into()), "1"),
            Message::tool_result(Some("b".into()), "2"),
            sized(Role::User, 1),
        ]);
        for budget in 0..20 {
            let limits = TailLimits { budget, ..wide() };
            let b = find_preserve_boundary(&t, &limits);
            if let Some(b) = b {
                assert!(!(3..=5).contains(&b), "budget {budget}: split at {b}");
            }
        }
        // A budget that reaches into the results pulls in the assistant message.
        let tail_tokens = t.tokens(4..7);
        let limits = TailLimits {
            budget: tail_tokens,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(2));
    }

    #[test]
    fn a_result_deep_in_the_tail_pulls_its_call_in() {
        // A result answering a call made before the boundary (interleaved user message).
        let mut late = Message::tool_result(Some("x".into()), "late");
        late.tokens = 1;
        let t = Transcript::new(vec![
            sized(Role::User, 100),
            Message::new(Role::Assistant, vec![call("x", "bash", "{}")]),
            sized(Role::User, 100),
            sized(Role::User, 1),
            late,
            sized(Role::User, 1),
        ]);
        let limits = TailLimits {
            budget: 3,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(1));
    }

    /// An Anthropic user message answering calls with tool-result parts.
    fn results(ids: &[&str]) -> Message {
        let parts = ids
            .iter()
            .map(|id| {
                Part::ToolResult(ToolResult {
                    call_id: Some(id.to_string()),
                    name: None,
                    content: vec![Part::Text("out".into())],
                    is_error: false,
                })
            })
            .collect();
        Message::new(Role::User, parts)
    }

    fn thinking() -> Part {
        Part::Reasoning("hmm".into())
    }

    #[test]
    fn a_user_message_of_parallel_tool_results_stays_with_its_calls() {
        // user, assistant(3 parallel calls), user(3 results + text), assistant, user
        let mut answer = results(&["a", "b", "c"]);
        answer.parts.push(Part::Text("also this".into()));
        let t = Transcript::new(vec![
            sized(Role::User, 1),
            Message::new(
                Role::Assistant,
                vec![
                    call("a", "Read", "{}"),
                    call("b", "Read", "{}"),
                    call("c", "Bash", "{}"),
                ],
            ),
            answer,
            sized(Role::Assistant, 1),
            sized(Role::User, 1),
        ]);
        assert_eq!(t.head_len(), 0);
        assert_eq!(t.last_user(), Some(4));
        for budget in 0..40 {
            let limits = TailLimits { budget, ..wide() };
            if let Some(b) = find_preserve_boundary(&t, &limits) {
                assert_ne!(b, 2, "budget {budget}: tail starts on tool results");
            }
        }
        let limits = TailLimits {
            budget: t.tokens(2..5),
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(1));
    }

    #[test]
    fn a_result_answering_an_earlier_assistant_pulls_it_in() {
        // Results for calls of two different assistant messages in one user message (odd,
        // but the earliest call wins).
        let t = Transcript::new(vec![
            sized(Role::User, 50),
            Message::new(Role::Assistant, vec![call("x", "bash", "{}")]),
            sized(Role::User, 50),
            Message::new(Role::Assistant, vec![call("y", "bash", "{}")]),
            results(&["y", "x"]),
            sized(Role::Assistant, 1),
        ]);
        assert_eq!(t.pairs()[4], Some(1));
        let limits = TailLimits {
            budget: 10,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(1));
    }

    #[test]
    fn thinking_tool_loops_are_cut_only_before_their_own_thinking() {
        // One turn: thinking only at its start (no interleaved thinking).
        let loop_turn = |interleaved: bool| {
            let mut m = vec![sized(Role::User, 100), sized(Role::Assistant, 100)];
            m.push(sized(Role::User, 5)); // the task: index 2
            for i in 0..6 {
                let id = format!("c{i}");
                let mut parts = vec![call(&id, "bash", "{}")];
                if i == 0 || interleaved {
                    parts.insert(0, thinking());
                }
                let mut a = Message::new(Role::Assistant, parts);
                a.tokens = 10;
                m.push(a);
                let mut r = results(&[&id]);
                r.tokens = 10;
                m.push(r);
            }
            Transcript::new(m)
        };
        let limits = TailLimits {
            budget: 45,
            turn_max_tokens: 0,
            ..wide()
        };
        // Budget alone would start at the fifth call (index 11).
        let plain = loop_turn(true);
        assert_eq!(find_preserve_boundary(&plain, &limits), Some(11));
        assert_eq!(plain.turn_start(11), 3);
        // Without interleaved thinking the whole loop stays with the thinking that opened it.
        let t = loop_turn(false);
        assert_eq!(find_preserve_boundary(&t, &limits), Some(3));
        assert!(t.messages[3].starts_with_reasoning());
        // Chat-style tool messages are not Anthropic tool loops: no such rule.
        let mut chat = t.clone();
        for m in &mut chat.messages {
            if m.is_tool_answer() {
                let id = m.tool_results().next().and_then(|r| r.call_id.clone());
                *m = Message::tool_result(id, "out");
                m.tokens = 10;
            }
        }
        assert_eq!(find_preserve_boundary(&chat, &limits), Some(11));
    }

    #[test]
    fn consecutive_messages_the_api_merges_are_one_turn_for_thinking() {
        let sized_msg = |role: Role, parts: Vec<Part>, tokens: usize| {
            let mut m = Message::new(role, parts);
            m.tokens = tokens;
            m
        };
        let limits = TailLimits {
            budget: 25,
            turn_max_tokens: 0,
            ..wide()
        };
        // Thinking and text in one assistant message, the call in the next: the API sees one
        // turn opening with thinking. A tail may not start at the call.
        let mut r = results(&["t1"]);
        r.tokens = 10;
        let t = Transcript::new(vec![
            sized(Role::User, 100),
            sized_msg(
                Role::Assistant,
                vec![thinking(), Part::Text("let me look".into())],
                100,
            ),
            sized_msg(Role::Assistant, vec![call("t1", "bash", "{}")], 10),
            r,
        ]);
        // Budget alone would start at the call (index 2); the turn's thinking comes first.
        assert_eq!(find_preserve_boundary(&t, &limits), Some(1));

        // A user text message after the tool results (merged into them by the API) continues
        // the loop: neither it nor the next call may open the tail.
        let mut r1 = results(&["t1"]);
        r1.tokens = 5;
        let mut r2 = results(&["t2"]);
        r2.tokens = 5;
        let t = Transcript::new(vec![
            sized(Role::User, 100),
            sized(Role::Assistant, 100),
            sized(Role::User, 5), // the task: index 2
            sized_msg(
                Role::Assistant,
                vec![thinking(), call("t1", "bash", "{}")],
                100,
            ),
            r1,
            sized(Role::User, 5), // a reminder, sent as its own message: index 5
            sized_msg(Role::Assistant, vec![call("t2", "bash", "{}")], 5),
            r2,
        ]);
        for budget in 0..110 {
            let limits = TailLimits { budget, ..limits };
            if let Some(b) = find_preserve_boundary(&t, &limits) {
                assert!(
                    b <= 3,
                    "budget {budget}: the tail starts at {b}, inside the thinking turn"
                );
            }
        }
    }

    #[test]
    fn a_split_assistant_message_in_a_thinking_loop_keeps_the_turn_whole() {
        // The turn opens with thinking (index 1); a later step of its tool loop is sent as two
        // assistant messages, text then the call, neither opening with thinking. The API
        // merges them, so a tail may start at neither: only where the turn's thinking is.
        let mut r1 = results(&["t1"]);
        r1.tokens = 5;
        let mut r2 = results(&["t2"]);
        r2.tokens = 5;
        let mut t1 = Message::new(Role::Assistant, vec![thinking(), call("t1", "bash", "{}")]);
        t1.tokens = 100;
        let mut said = Message::new(Role::Assistant, vec![Part::Text("next".into())]);
        said.tokens = 5;
        let mut t2 = Message::new(Role::Assistant, vec![call("t2", "bash", "{}")]);
        t2.tokens = 5;
        let t = Transcript::new(vec![sized(Role::User, 100), t1, r1, said, t2, r2]);
        for budget in 0..210 {
            let limits = TailLimits {
                budget,
                turn_max_tokens: 0,
                ..wide()
            };
            if let Some(b) = find_preserve_boundary(&t, &limits) {
                assert_eq!(
                    b, 1,
                    "budget {budget}: the tail starts inside the thinking turn"
                );
            }
        }
    }

    #[test]
    fn a_reasoning_item_stays_with_the_output_it_produced() {
        // Responses: reasoning, function_call, output, reasoning, message, user.
        let reasoning = || {
            let mut m = Message::new(Role::Assistant, vec![thinking()]);
            m.tokens = 10;
            m
        };
        // Responses: reasoning, message, function_call (one response), output, reasoning,
        // message, user.
        let t = Transcript::new(vec![
            sized(Role::User, 100),
            reasoning(),
            sized(Role::Assistant, 10),
            Message::new(Role::Assistant, vec![call("c", "shell", "{}")]),
            Message::tool_result(Some("c".into()), "out"),
            reasoning(),
            sized(Role::Assistant, 5),
            sized(Role::User, 1),
        ]);
        let limits = TailLimits {
            budget: 6,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(5));
        // Budgets that reach the function call or the message pull in the reasoning item.
        for from in [2, 3] {
            let limits = TailLimits {
                budget: t.tokens(from..8),
                ..wide()
            };
            assert_eq!(find_preserve_boundary(&t, &limits), Some(1), "from {from}");
        }
    }

    #[test]
    fn parallel_calls_stay_together_even_before_their_results() {
        // Responses: a response's three parallel calls end the request (their results come in
        // the next one, in any order): a budget reaching only the last call keeps them all.
        let call_of = |id: &str| {
            let mut m = Message::new(Role::Assistant, vec![call(id, "shell", "{}")]);
            m.tokens = 10;
            m
        };
        let mut t = Transcript::new(vec![
            sized(Role::User, 100),
            sized(Role::Assistant, 100),
            sized(Role::User, 100),
            call_of("a"),
            call_of("b"),
            call_of("c"),
        ]);
        // (No allowance for keeping the latest user message: the calls alone decide.)
        for budget in [10, 20, 30] {
            let limits = TailLimits {
                budget,
                turn_max_tokens: 0,
                ..wide()
            };
            assert_eq!(
                find_preserve_boundary(&t, &limits),
                Some(3),
                "budget {budget}"
            );
        }
        // Once answered (out of order), the same holds.
        t.messages
            .push(Message::tool_result(Some("b".into()), "out b"));
        t.messages
            .push(Message::tool_result(Some("a".into()), "out a"));
        t.messages
            .push(Message::tool_result(Some("c".into()), "out c"));
        let limits = TailLimits {
            budget: t.tokens(5..9),
            turn_max_tokens: 0,
            ..wide()
        };
        assert_eq!(find_preserve_boundary(&t, &limits), Some(3));
    }

    #[test]
    fn nothing_to_compact() {
        let only_system = Transcript::new(vec![sized(Role::System, 1), sized(Role::User, 1)]);
        assert_eq!(find_preserve_boundary(&only_system, &wide()), None);
        assert_eq!(
            find_preserve_boundary(&Transcript::default(), &wide()),
            None
        );
        // The whole conversation is one tool exchange after the system prompt.
        let t = Transcript::new(vec![
            sized(Role::System, 1),
            Message::new(Role::Assistant, vec![call("a", "bash", "{}")]),
            Message::tool_result(Some("a".into()), "x"),
        ]);
        assert_eq!(
            find_preserve_boundary(
                &t,
                &TailLimits {
                    budget: 0,
                    ..wide()
                }
            ),
            None
        );
        let t2 = Transcript::new(vec![
            Message::new(Role::User, vec![Part::Text("hi".into())]),
            Message::new(Role::User, vec![Part::Text("again".into())]),
        ]);
        assert_eq!(find_preserve_boundary(&t2, &wide()), Some(1));
    }
}
