//! When compacting before the trigger pays for itself: the cost trigger.
//!
//! A conversation's old turns cost money on every request even when the provider's prompt
//! cache holds them: each is read again at the cache-read price. A compaction ends that, but
//! costs once: the summarizer's call (its instructions and the previous summary read, the new
//! summary written at the output price) and the part of the request that stays (opening,
//! summary, tail), sent after the compaction as new input instead of read from the cache.
//! Compacting only at the window's trigger keeps paying those reads on ever more tokens; an
//! agent compacting itself at 90% of a 200k window carries ~90k tokens per request on average.
//!
//! This is a rent-or-buy choice, decided the way the classic ski-rental rule decides it: keep
//! paying the reads ("rent") of the part a compaction would remove until they add up to what a
//! compaction costs ("buy"), then compact. The rule needs no forecast: for a conversation
//! growing at a steady pace it compacts when the removable part reaches
//! `sqrt(2 · growth per turn · compaction cost ÷ read price)` tokens, the size at which the cost
//! per turn is least (the reads grow with the part, the compactions' share shrinks with it);
//! for one that stops growing it never spends more than twice the best choice made knowing the
//! future. The summarizer's reading of the removed turns is left out of the cost: each turn is
//! summarised once whatever the schedule. The summary a compaction writes is expected to be as
//! long as the one the request already carries ([`SUMMARY_TOKENS`] before the first): the rule
//! weighs what this conversation's summarizer writes, not a constant.
//!
//! Prices are the conversation's model's (a summarizer on a cheaper model only makes
//! compacting pay sooner). A model without a price never compacts early. What is followed is
//! this process's view of each conversation, in memory and bounded like [`super::pace`]: a
//! replica sees only the requests routed to it, which makes it compact later, never sooner.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Mutex, PoisonError};

use crate::config::Price;

/// Conversations followed at most (forgotten all at once when full).
const MAX_FOLLOWED: usize = 16_384;

/// Tokens of a summary the rule expects a first compaction to write (the agents' own summaries
/// run 1,000 to 4,000 tokens). Once a summary is in the request, the next is expected to be as
/// long as it: each refines the one before, and a summarizer writes summaries of about the same
/// size (the `extractive` backend ~600 tokens, an LLM what its model makes of the prompt).
pub const SUMMARY_TOKENS: usize = 2_000;

/// Tokens of the summarizer's instructions around what it summarises.
const INSTRUCTIONS_TOKENS: usize = 1_000;

/// A model's prices as multiples of its input price: what the rule weighs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Economics {
    /// A token read from the prompt cache.
    read: f64,
    /// A token sent after a compaction: new input, or a cache write on Anthropic Messages
    /// (whose agents mark their latest message as a cache breakpoint).
    write: f64,
    /// An output token.
    output: f64,
}

impl Economics {
    /// The economics of a model priced `price`; `anthropic` for a Messages request. `None`
    /// for a price that makes input free (nothing to weigh).
    pub fn of(price: &Price, anthropic: bool) -> Option<Economics> {
        let input = price.input;
        if !(input.is_finite() && input > 0.0) {
            return None;
        }
        let written = if anthropic {
            price.cache_write()
        } else {
            input
        };
        Some(Economics {
            read: price.cache_read() / input,
            write: written / input,
            output: price.output / input,
        })
    }

    /// What one compaction costs, in input tokens, when `kept` tokens stay in the request and
    /// its summary is `summary` tokens long: the kept part sent anew instead of read from the
    /// cache, the previous summary and the instructions read by the summarizer, and the new
    /// summary written.
    pub fn compaction(&self, kept: usize, summary: usize) -> f64 {
        (self.write - self.read).max(0.0) * kept as f64
            + (INSTRUCTIONS_TOKENS + summary) as f64
            + self.output * summary as f64
    }
}

/// One conversation since its forwarded request last changed shape.
#[derive(Debug, Clone, Copy)]
struct Cycle {
    /// What was made of the requests: the summary in use and the outputs masked.
    shape: Shape,
    /// Estimated tokens forwarded at the cycle's first request.
    base: usize,
    /// Tokens of the summary a compaction is expected to write: the summary in the request,
    /// [`SUMMARY_TOKENS`] before the first.
    summary: usize,
    /// Estimated tokens received and forwarded at its latest request.
    received: usize,
    forwarded: usize,
    /// Reads of the removable part paid so far, in input tokens.
    rent: f64,
    /// Whether the rent has reached what a compaction costs.
    due: bool,
}

/// What a forwarded request carries in place of the conversation's older turns: the number
/// of the summary spliced in (0 for none) and how many outputs are masked. A request of
/// another shape than the one before is a compaction (or an edit): its cached prefix starts
/// anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Shape {
    /// The summary's `compaction_num`.
    pub summary: u32,
    /// Outputs masked.
    pub masked: usize,
}

impl Cycle {
    fn new(shape: Shape, received: usize, forwarded: usize, summary: usize) -> Cycle {
        Cycle {
            shape,
            base: forwarded,
            summary,
            received,
            forwarded,
            rent: 0.0,
            due: false,
        }
    }
}

/// The rent of every followed conversation.
#[derive(Debug, Default)]
pub struct Payback {
    conversations: Mutex<HashMap<u64, Cycle, foldhash::fast::RandomState>>,
    /// Fingerprints conversation keys (foldhash, seeded per process: a lookup per request).
    keys: foldhash::fast::RandomState,
}

impl Payback {
    /// Whether compacting conversation `key` now pays: the reads of what a compaction would
    /// remove have cost, since its forwarded request last became smaller, at least what a
    /// compaction costs.
    pub fn due(&self, key: &impl Hash) -> bool {
        let key = self.keys.hash_one(key);
        self.lock().get(&key).is_some_and(|c| c.due)
    }

    /// Records a request of conversation `key`: `received` estimated tokens as the agent sent
    /// it, `forwarded` as it went upstream in `shape`. The part a compaction would remove is
    /// what it forwarded beyond the cycle's first request and `extra`, the tail and summary a
    /// first compaction will add to that (0 once a summary is in the request). A request of
    /// another shape than the last (a summary spliced in, outputs masked) or a shorter one
    /// (an edit) starts a new cycle; the same request again (a retry) pays nothing more.
    /// `summary` gives the tokens of the summary in the request (`None` without one); it is
    /// asked only when a cycle starts.
    pub fn observe(
        &self,
        key: &impl Hash,
        shape: Shape,
        (received, forwarded): (usize, usize),
        extra: usize,
        economics: &Economics,
        summary: impl FnOnce() -> Option<usize>,
    ) {
        let key = self.keys.hash_one(key);
        let mut conversations = self.lock();
        if conversations.len() >= MAX_FOLLOWED && !conversations.contains_key(&key) {
            conversations.clear();
        }
        let start = |summary: Option<usize>| {
            Cycle::new(
                shape,
                received,
                forwarded,
                summary.unwrap_or(SUMMARY_TOKENS),
            )
        };
        let Some(cycle) = conversations.get_mut(&key) else {
            conversations.insert(key, start(summary()));
            return;
        };
        if shape != cycle.shape || forwarded < cycle.forwarded || received < cycle.received {
            *cycle = start(summary());
            return;
        }
        if received == cycle.received {
            return;
        }
        let kept = cycle.base.saturating_add(extra);
        cycle.rent += economics.read * forwarded.saturating_sub(kept) as f64;
        cycle.received = received;
        cycle.forwarded = forwarded;
        cycle.due = cycle.rent >= economics.compaction(kept, cycle.summary);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Cycle, foldhash::fast::RandomState>> {
        self.conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-5's prices: cache reads a tenth of input, output eight times it.
    fn gpt5() -> Economics {
        let price = Price {
            input: 1.25,
            output: 10.0,
            cache_read: Some(0.125),
            cache_write: None,
        };
        Economics::of(&price, false).expect("priced")
    }

    #[test]
    fn prices_become_multiples_of_input_and_anthropic_writes_cost_more() {
        let e = gpt5();
        assert!(
            (e.read - 0.1).abs() < 1e-9 && (e.write - 1.0).abs() < 1e-9,
            "{e:?}"
        );
        assert!((e.output - 8.0).abs() < 1e-9, "{e:?}");
        let sonnet = Price {
            input: 3.0,
            output: 15.0,
            cache_read: Some(0.3),
            cache_write: Some(3.75),
        };
        let anthropic = Economics::of(&sonnet, true).expect("priced");
        assert!((anthropic.write - 1.25).abs() < 1e-9, "{anthropic:?}");
        // Keeping 10,000 tokens costs their rewrite less their read: 1.15 each on Anthropic.
        let kept =
            anthropic.compaction(10_000, SUMMARY_TOKENS) - anthropic.compaction(0, SUMMARY_TOKENS);
        assert!((kept - 11_500.0).abs() < 1e-6, "{kept}");
        let free = Price {
            input: 0.0,
            output: 0.0,
            cache_read: None,
            cache_write: None,
        };
        assert_eq!(Economics::of(&free, false), None);
    }

    /// A conversation growing 1,000 tokens a turn from a 5,000-token opening, with 7,000 more
    /// kept by a first compaction: due once the reads of what lies beyond 12,000 tokens add up
    /// to a compaction, and not a request before.
    #[test]
    fn due_once_the_reads_of_the_removable_part_reach_a_compaction() {
        let payback = Payback::default();
        let e = gpt5();
        let cost = e.compaction(12_000, SUMMARY_TOKENS);
        let mut rent = 0.0;
        let mut turns = 0;
        for turn in 0..200 {
            let tokens = 5_000 + turn * 1_000;
            assert_eq!(payback.due(&"c"), rent >= cost, "turn {turn}");
            if payback.due(&"c") {
                break;
            }
            payback.observe(&"c", Shape::default(), (tokens, tokens), 7_000, &e, || None);
            rent += 0.1 * tokens.saturating_sub(12_000) as f64;
            turns = turn;
        }
        assert!(payback.due(&"c"), "never due");
        // sqrt(2 · 1,000 · cost ÷ 0.1) tokens past the kept part, give or take a turn.
        let expected = (2.0 * 1_000.0 * cost / 0.1).sqrt() / 1_000.0 + 7.0;
        assert!(
            (turns as f64 - expected).abs() <= 1.5,
            "{turns} turns, expected {expected}"
        );
        // Another conversation is its own.
        assert!(!payback.due(&"other"));
    }

    /// Grows conversation `key` in `shape` from `from` tokens by 1,000 a request until it is
    /// due; the tokens it reached.
    fn grow_until_due(payback: &Payback, key: &str, shape: Shape, from: usize) -> usize {
        let e = gpt5();
        for step in 0..1_000 {
            let tokens = from + step * 1_000;
            payback.observe(&key, shape, (tokens, tokens), 0, &e, || None);
            if payback.due(&key) {
                return tokens;
            }
        }
        panic!("never due");
    }

    #[test]
    fn the_summary_in_the_request_sets_what_the_next_compaction_is_expected_to_cost() {
        // The same growth after a 600-token summary and after a 4,000-token one: a short
        // summary makes the next compaction cheap, so it pays sooner.
        let e = gpt5();
        let reach = |summary: usize| {
            let payback = Payback::default();
            let shape = Shape {
                summary: 1,
                masked: 0,
            };
            let mut asked = 0;
            for step in 0..1_000 {
                let tokens = 8_000 + step * 1_000;
                payback.observe(&"c", shape, (tokens, tokens), 0, &e, || {
                    asked += 1;
                    Some(summary)
                });
                if payback.due(&"c") {
                    // Asked once, when the cycle started.
                    assert_eq!(asked, 1);
                    return tokens;
                }
            }
            panic!("never due");
        };
        let (short, long) = (reach(600), reach(4_000));
        assert!(short < long, "{short} vs {long}");
        // Without a summary in the request, a first one is expected to be SUMMARY_TOKENS long.
        let first = grow_until_due(&Payback::default(), "c", Shape::default(), 8_000);
        assert!(short < first && first < long, "{short} {first} {long}");
    }

    #[test]
    fn another_shape_or_a_shorter_request_starts_a_new_cycle_and_a_retry_pays_nothing() {
        let payback = Payback::default();
        let e = gpt5();
        let plain = Shape::default();
        let reached = grow_until_due(&payback, "c", plain, 1_000);
        // A summary spliced in, even one leaving the request larger than the last: a new
        // cycle, from the new request's size.
        let summarised = Shape {
            summary: 1,
            masked: 0,
        };
        payback.observe(
            &"c",
            summarised,
            (reached + 500, reached + 500),
            0,
            &e,
            || None,
        );
        assert!(!payback.due(&"c"));
        // The same request again, many times: no rent.
        for _ in 0..1_000 {
            payback.observe(
                &"c",
                summarised,
                (reached + 500, reached + 500),
                0,
                &e,
                || None,
            );
        }
        assert!(!payback.due(&"c"));
        // The cycle runs from there, longer than the first: it keeps more, which costs more
        // to send anew, so a compaction pays later.
        let again = grow_until_due(&payback, "c", summarised, reached + 500);
        assert!(
            again - (reached + 500) > reached - 1_000,
            "{again} after {reached}"
        );
        // Outputs masked: a new cycle too; and so is an edited, shorter conversation.
        let masked = Shape {
            summary: 1,
            masked: 10,
        };
        payback.observe(&"c", masked, (again + 1_000, again), 0, &e, || None);
        assert!(!payback.due(&"c"));
        grow_until_due(&payback, "c", masked, again);
        payback.observe(&"c", masked, (1_000, 1_000), 0, &e, || None);
        assert!(!payback.due(&"c"));
    }
}
