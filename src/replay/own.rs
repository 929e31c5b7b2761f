//! What a replayed session would cost if the agent compacted it itself, as Claude Code, Codex
//! and opencode do without compactor: the baseline compactor has to beat to pay.
//!
//! The agents' own compaction is modelled from the requests as received (recordings of an
//! agent that did not compact): when a request reaches [`OWN_TRIGGER`] of the usable window,
//! the agent asks its model for a summary of the whole history (one more request, read from
//! the prompt cache as far as it repeats the last one, answered with [`OWN_SUMMARY_TOKENS`]
//! output tokens), then goes on from its opening (the first request: system prompt, project
//! instructions, task), the summary and what the conversation adds from there. Every request
//! is priced as the replay prices compactor's: the part that repeats the previous request's
//! prefix read from the cache ([`cached_prefix`]), the rest as new input (as cache writes on
//! Anthropic Messages, whose agents mark their latest message as a breakpoint). The figures
//! are estimated tokens, like every replay figure; what differs between agents (Claude Code
//! compacts a little later, Codex keeps recent user messages verbatim) moves them by a few
//! percent, not the comparison.

use crate::config::Price;
use crate::cost::cached_prefix;

/// Share of the usable window at which the modelled agent compacts its own history (Codex's
/// default auto-compact limit is 90% of the window; Claude Code compacts a little later).
pub const OWN_TRIGGER: f64 = 0.9;

/// Output tokens of the modelled agent's summary (the agents' own summaries run 1,000 to
/// 4,000 tokens).
pub const OWN_SUMMARY_TOKENS: usize = 2_000;

/// The modelled agent's own compaction of one session.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OwnCompaction {
    /// Times it compacted.
    pub compactions: usize,
    /// What its requests and its summary calls cost, in USD (input, and the summaries'
    /// output).
    pub usd: f64,
    /// Whether a request stayed over the usable window even so (its opening and a summary
    /// leave no room): the provider would have refused it, and the figure is no baseline.
    pub over_window: bool,
}

/// The agent's own compaction of a session whose requests, as received, held `received`
/// estimated tokens each, for a model of `usable_window` input tokens priced at `price`;
/// `anthropic` prices new input as cache writes.
pub fn own_compaction(
    received: &[usize],
    usable_window: usize,
    price: &Price,
    anthropic: bool,
) -> OwnCompaction {
    let uncached = if anthropic {
        price.cache_write()
    } else {
        price.input
    };
    let input = |tokens: usize, repeated: usize| {
        let cached = cached_prefix(repeated.min(tokens));
        ((tokens - cached) as f64 * uncached + cached as f64 * price.cache_read()) / 1e6
    };
    let trigger = (OWN_TRIGGER * usable_window as f64) as usize;
    let opening = received.first().copied().unwrap_or(0);
    let compacted = opening + OWN_SUMMARY_TOKENS;
    let mut own = OwnCompaction {
        compactions: 0,
        usd: 0.0,
        over_window: false,
    };
    // Tokens the agent's compactions have taken out of the history so far.
    let mut removed = 0;
    let mut previous: Option<usize> = None;
    for &r in received {
        let mut tokens = r.saturating_sub(removed);
        let mut repeated = previous.unwrap_or(0);
        // A compaction that would not leave room under the trigger is not worth making.
        if tokens >= trigger && compacted < trigger {
            // The summary call: the history so far, then the summary.
            own.usd += input(tokens, repeated) + OWN_SUMMARY_TOKENS as f64 * price.output / 1e6;
            own.compactions += 1;
            removed = r.saturating_sub(compacted);
            tokens = compacted;
            // After the compaction only the opening repeats a request the provider has seen.
            repeated = opening;
        }
        own.usd += input(tokens, repeated);
        own.over_window |= tokens > usable_window;
        previous = Some(tokens);
    }
    own
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRICE: Price = Price {
        input: 1.0,
        output: 10.0,
        cache_read: Some(0.1),
        cache_write: Some(1.25),
    };

    fn usd(tokens: usize, cached: usize, per_uncached: f64) -> f64 {
        ((tokens - cached) as f64 * per_uncached + cached as f64 * 0.1) / 1e6
    }

    #[test]
    fn below_its_trigger_the_agent_pays_for_the_requests_with_their_repeats_cached() {
        let own = own_compaction(&[2_000, 5_000, 8_000], 100_000, &PRICE, false);
        assert_eq!(own.compactions, 0);
        // 2,000 new; then 1,920 of 2,000 cached (128-token steps), 4,992 of 5,000.
        let expected = usd(2_000, 0, 1.0) + usd(5_000, 1_920, 1.0) + usd(8_000, 4_992, 1.0);
        assert!((own.usd - expected).abs() < 1e-12, "{own:?} vs {expected}");
        // On Anthropic Messages the new input is written to the cache.
        let anthropic = own_compaction(&[2_000, 5_000, 8_000], 100_000, &PRICE, true);
        let expected = usd(2_000, 0, 1.25) + usd(5_000, 1_920, 1.25) + usd(8_000, 4_992, 1.25);
        assert!((anthropic.usd - expected).abs() < 1e-12);
    }

    #[test]
    fn at_its_trigger_the_agent_summarises_and_goes_on_from_its_opening_and_the_summary() {
        // Window 10,000: the agent compacts at 9,000. Opening 1,500 tokens, summary 2,000.
        let own = own_compaction(&[1_500, 6_000, 9_500, 10_500], 10_000, &PRICE, false);
        assert_eq!(own.compactions, 1);
        assert!(!own.over_window);
        let first = usd(1_500, 0, 1.0);
        let second = usd(6_000, 1_408, 1.0);
        // The summary call reads the history (repeating the 6,000 before it) and writes the
        // summary; the request then holds the opening and the summary, the opening cached.
        let summary = usd(9_500, 5_888, 1.0) + 2_000.0 * 10.0 / 1e6;
        let third = usd(3_500, 1_408, 1.0);
        // 1,000 tokens later: 4,500, repeating the 3,500 before it.
        let fourth = usd(4_500, 3_456, 1.0);
        let expected = first + second + summary + third + fourth;
        assert!((own.usd - expected).abs() < 1e-12, "{own:?} vs {expected}");
    }

    #[test]
    fn an_opening_too_large_to_compact_under_the_trigger_is_never_compacted() {
        let own = own_compaction(&[8_000, 9_000, 9_500], 10_000, &PRICE, false);
        assert_eq!(own.compactions, 0);
        assert!(!own.over_window);
        let own = own_compaction(&[8_000, 9_000, 10_500], 10_000, &PRICE, false);
        assert!(own.over_window, "the provider refuses the last request");
    }
}
