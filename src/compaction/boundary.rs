//! The preserve boundary (seed §5.5, `FindPreserveBoundary`): which recent messages stay
//! verbatim.
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
//!    so it does not trip again right away) and something before it remains to compact. In a long agentic turn (one task message followed by
//!    hundreds of tool calls) keeping it is impossible; the summary then carries every user
//!    message (section 6 of the prompt);
//! 3. a tool call is never separated from its result: the tail never starts on a tool result,
//!    and when a tool result in the tail answers a call made before the boundary, the
//!    boundary moves back to that assistant message.
//!
//! Leading system/developer messages are never compacted; when no message is left between
//! them and the boundary there is nothing to compact.

use super::transcript::{Role, Transcript};
use crate::config::CompactionConfig;

/// The seed's `MinPreserveRecentTokens`: floor of the preserve budget.
pub const MIN_PRESERVE_RECENT_TOKENS: usize = 2_000;

/// The seed's `MaxPreserveRecentTokens`: ceiling of the preserve budget.
pub const MAX_PRESERVE_RECENT_TOKENS: usize = 15_000;

/// `preserve_ratio × usable_window`, clamped to the configured min and max preserve tokens.
pub fn preserve_budget(config: &CompactionConfig, usable_window: usize) -> usize {
    let scaled = (config.preserve_ratio * usable_window as f64).floor();
    let scaled = if scaled.is_finite() && scaled > 0.0 {
        scaled.min(usize::MAX as f64) as usize
    } else {
        0
    };
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
    let n = t.len();
    let head = t.head_len();
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

    // Keep tool calls with their results.
    let pairs = t.pairs();
    // suffix_min[j] = the earliest assistant index answered by a tool result at j or later.
    let mut suffix_min = vec![usize::MAX; n + 1];
    for j in (0..n).rev() {
        let here = pairs.get(j).copied().flatten().unwrap_or(usize::MAX);
        suffix_min[j] = here.min(suffix_min[j + 1]);
    }
    loop {
        while b > head && messages.get(b).map(|m| m.role) == Some(Role::Tool) {
            b = match pairs.get(b).copied().flatten() {
                Some(a) if a < b => a,
                _ => b - 1,
            };
        }
        let earliest = suffix_min.get(b).copied().unwrap_or(usize::MAX);
        if earliest < b {
            b = earliest;
        } else {
            break;
        }
    }

    (b > head).then_some(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::transcript::tests::{call, text};
    use crate::compaction::transcript::{Message, Part};

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
    fn preserve_constants_match_the_seed_and_config() {
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
