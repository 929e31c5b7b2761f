//! What a request cost: a model's [`Price`] applied to the provider's [`Usage`].
//!
//! Providers bill input read from their prompt cache and input written to it apart from the
//! rest: OpenAI reads cached input at a discount and charges nothing extra to write it;
//! Anthropic reads at a tenth of the input price and writes at a premium. [`Usage`] is already
//! normalised (its `input` counts every input token, cached and cache-written ones included),
//! so one rule prices both: the input not read from or written to the cache at `input`, the
//! rest at `cache_read` and `cache_write`, the output at `output`. A model whose table entry
//! names no price has no [`Bill`]: no figure rather than a zero that would read as a saving.
//!
//! Beside what was billed, what the request the agent sent would have cost without compactor
//! (the counterfactual): its estimated tokens scaled by the response's own actual ÷ estimated
//! input, with the part that repeats the session's previous request read from the prompt cache
//! ([`Repeats`], [`cached_prefix`]: the provider caches a prefix it has seen, from
//! [`MIN_CACHED_TOKENS`] on, in [`CACHE_STEP_TOKENS`] steps, as OpenAI does automatically) and
//! the rest as new input (for Anthropic Messages, written to the cache: agents mark their
//! latest message as a cache breakpoint). The output is the same either way.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, PoisonError};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::Price;
use crate::session::TenantId;
use crate::usage::Usage;

/// The smallest prefix a provider caches, in tokens (OpenAI's rule; Anthropic's smallest
/// cacheable prompt for its Sonnet and Opus models is the same).
pub const MIN_CACHED_TOKENS: usize = 1024;

/// Cached prefixes grow in steps of this many tokens (OpenAI).
pub const CACHE_STEP_TOKENS: usize = 128;

/// Of a prefix of `tokens` a provider has seen, what its cache serves.
pub fn cached_prefix(tokens: usize) -> usize {
    if tokens < MIN_CACHED_TOKENS {
        0
    } else {
        tokens / CACHE_STEP_TOKENS * CACHE_STEP_TOKENS
    }
}

/// Sessions remembered at most by [`Repeats`] before it starts over.
const MAX_REPEATS: usize = 65_536;

/// What each session's previous request held, to tell how much of the next one repeats it,
/// per tenant and session (bounded, emptied when full). Where the scan memo compared the
/// request with the conversation's previous one byte for byte, its leading messages up to the
/// first that differs repeat it (what a prefix cache serves), and nothing is hashed. Otherwise
/// (a request too short or too large for the memo, a memo emptied) the previous request's
/// message count and a fingerprint of those messages' bytes (XXH3, random seed per process)
/// decide: a request that starts with all of them repeats them, one that does not repeats none
/// (an underestimate). A request the memo holds is not fingerprinted: the next one will be
/// compared by the memo.
#[derive(Debug)]
pub struct Repeats {
    seed: u64,
    /// Per tenant and session fingerprint: the previous request's message count and the
    /// fingerprint of its messages, when they were hashed.
    table: Mutex<HashMap<SessionKey, (usize, Option<u64>), foldhash::fast::RandomState>>,
}

/// A tenant and the fingerprint of a session id.
type SessionKey = (TenantId, u64);

impl Default for Repeats {
    fn default() -> Self {
        Repeats {
            seed: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
            table: Mutex::new(HashMap::default()),
        }
    }
}

impl Repeats {
    /// How many leading `messages` repeat the previous request of `tenant`'s `session`, and
    /// remembers these as the previous request. `known`: the leading messages the scan memo
    /// found byte for byte in an earlier request of the tenant's conversation (0 when it
    /// found none); `held`: whether the memo now holds this request's messages (then the next
    /// request's `known` answers for them, and they are not fingerprinted; if the memo drops
    /// them before, that request counts no repeats: an underestimate).
    pub fn repeated(
        &self,
        tenant: &TenantId,
        session: &str,
        messages: &[&str],
        known: usize,
        held: bool,
    ) -> usize {
        let key = (*tenant, xxh3_64_with_seed(session.as_bytes(), self.seed));
        let previous = self
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .copied();
        match previous {
            Some(_) if known > 0 => {
                self.remember(key, messages.len(), None);
                return known.min(messages.len());
            }
            // Nothing to compare with, and the memo holds this request for the next one: no
            // fingerprint is needed (a new conversation's first request, or one whose earlier
            // requests the memo could not hold).
            Some((_, None)) | None if held => {
                self.remember(key, messages.len(), None);
                return 0;
            }
            _ => {}
        }
        // One pass hashes each message once: the fingerprint of the previous request's count
        // of messages is taken on the way to the whole request's.
        let mut print = self.seed;
        let mut at_previous = None;
        for (i, m) in messages.iter().enumerate() {
            if previous.is_some_and(|(n, _)| n == i) {
                at_previous = Some(print);
            }
            print = xxh3_64_with_seed(m.as_bytes(), print.rotate_left(17) ^ m.len() as u64);
        }
        if previous.is_some_and(|(n, _)| n == messages.len()) {
            at_previous = Some(print);
        }
        let repeated = match previous {
            Some((n, Some(before))) if at_previous == Some(before) => n,
            _ => 0,
        };
        self.remember(key, messages.len(), Some(print));
        repeated
    }

    fn remember(&self, key: SessionKey, messages: usize, print: Option<u64>) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= MAX_REPEATS && !table.contains_key(&key) {
            table.clear();
        }
        table.insert(key, (messages, print));
    }
}

/// What a request of `tokens` estimated tokens would have cost without compactor, given that
/// `cached` of them repeat what the provider saw before, when the request actually sent was
/// `forwarded` estimated tokens and billed `usage` (whose output it keeps). The part compactor
/// left out (`tokens` less `forwarded`) is counted at `calibration`, the model's ratio of
/// billed to estimated input over its requests (mostly whole conversations), when one was
/// learned, else at this request's own ratio: a compacted request's mix of text (a summary,
/// few old tool outputs) is not the mix of what it left out.
pub fn without_compactor(
    price: &Price,
    anthropic: bool,
    (tokens, cached): (usize, usize),
    forwarded: usize,
    usage: &Usage,
    calibration: Option<f64>,
) -> Bill {
    let own = if forwarded == 0 {
        1.0
    } else {
        usage.input as f64 / forwarded as f64
    };
    let input = if tokens >= forwarded {
        let left_out = calibration
            .filter(|f| f.is_finite() && *f > 0.0)
            .unwrap_or(own);
        usage.input as f64 + (tokens - forwarded) as f64 * left_out
    } else {
        tokens as f64 * own
    };
    // `as` saturates.
    let cache_read = if tokens == 0 {
        0
    } else {
        ((input * cached as f64 / tokens as f64) as u64).min(input as u64)
    };
    let input = input as u64;
    let new = input - cache_read;
    Bill::of(
        &Usage {
            input,
            output: usage.output,
            cache_read,
            cache_write: if anthropic { new } else { 0 },
        },
        price,
    )
}

/// One response's cost in USD, by what it was for.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Bill {
    /// Input read without the prompt cache.
    pub input: f64,
    /// Input read from the prompt cache.
    pub cache_read: f64,
    /// Input written to the prompt cache.
    pub cache_write: f64,
    /// Output (reasoning included).
    pub output: f64,
}

impl Bill {
    /// What `usage` costs at `price` (USD per million tokens).
    pub fn of(usage: &Usage, price: &Price) -> Bill {
        let per_token = |usd_per_million: f64| usd_per_million / 1_000_000.0;
        // A provider reporting more cached than total input: the cached figures stand, the
        // rest is none.
        let uncached = usage
            .input
            .saturating_sub(usage.cache_read)
            .saturating_sub(usage.cache_write);
        Bill {
            input: uncached as f64 * per_token(price.input),
            cache_read: usage.cache_read as f64 * per_token(price.cache_read()),
            cache_write: usage.cache_write as f64 * per_token(price.cache_write()),
            output: usage.output as f64 * per_token(price.output),
        }
    }

    /// USD by kind, in the order of [`crate::metrics::COST_KINDS`].
    pub fn by_kind(&self) -> [f64; 4] {
        [self.input, self.cache_read, self.cache_write, self.output]
    }

    /// The whole of it.
    pub fn total(&self) -> f64 {
        self.input + self.cache_read + self.cache_write + self.output
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    const GPT_5: Price = Price {
        input: 1.25,
        output: 10.0,
        cache_read: Some(0.125),
        cache_write: Some(1.25),
    };

    const SONNET: Price = Price {
        input: 3.0,
        output: 15.0,
        cache_read: Some(0.30),
        cache_write: Some(3.75),
    };

    #[test]
    fn openai_cached_input_is_read_at_its_price_and_the_rest_at_the_input_price() {
        // 100k input of which 80k cached, 2k output.
        let usage = Usage {
            input: 100_000,
            output: 2_000,
            cache_read: 80_000,
            cache_write: 0,
        };
        let bill = Bill::of(&usage, &GPT_5);
        assert!(close(bill.input, 20_000.0 * 1.25e-6), "{bill:?}");
        assert!(close(bill.cache_read, 80_000.0 * 0.125e-6), "{bill:?}");
        assert!(close(bill.cache_write, 0.0));
        assert!(close(bill.output, 2_000.0 * 10e-6));
        assert!(close(bill.total(), 0.025 + 0.01 + 0.02));
    }

    #[test]
    fn anthropic_cache_writes_cost_more_and_reads_less() {
        // Normalised as the usage scanner does: input = uncached 1k + read 50k + written 9k.
        let usage = Usage {
            input: 60_000,
            output: 500,
            cache_read: 50_000,
            cache_write: 9_000,
        };
        let bill = Bill::of(&usage, &SONNET);
        assert!(close(bill.input, 1_000.0 * 3e-6), "{bill:?}");
        assert!(close(bill.cache_read, 50_000.0 * 0.3e-6));
        assert!(close(bill.cache_write, 9_000.0 * 3.75e-6));
        assert!(close(bill.output, 500.0 * 15e-6));
    }

    #[test]
    fn without_cache_fields_or_cache_prices_everything_is_input() {
        let usage = Usage {
            input: 10_000,
            output: 0,
            cache_read: 0,
            cache_write: 0,
        };
        let plain = Price {
            input: 2.0,
            output: 8.0,
            cache_read: None,
            cache_write: None,
        };
        assert!(close(Bill::of(&usage, &plain).total(), 0.02));
        // Cached tokens with no cache price are read at the input price: no discount assumed.
        let cached = Usage {
            cache_read: 10_000,
            ..usage
        };
        let bill = Bill::of(&cached, &plain);
        assert!(
            close(bill.input, 0.0) && close(bill.cache_read, 0.02),
            "{bill:?}"
        );
    }

    #[test]
    fn a_request_repeats_the_previous_one_only_when_it_starts_with_all_of_it() {
        let repeats = Repeats::default();
        let t = TenantId::from_credential("k");
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b"], 0, false),
            0,
            "nothing before"
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b", "c", "d"], 0, false),
            2
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b", "c", "d", "e"], 0, false),
            4
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b", "c", "d", "e"], 0, false),
            5,
            "the same request again (a retry) repeats all of it"
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b", "c", "d"], 0, false),
            0,
            "shorter: an edit"
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "b", "c", "d", "e"], 0, false),
            4
        );
        // An edit (or the agent's own compaction): nothing repeated, and it is the new base.
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "x", "c", "d", "e", "f"], 0, false),
            0
        );
        assert_eq!(
            repeats.repeated(&t, "s", &["a", "x", "c", "d", "e", "f", "g"], 0, false),
            6
        );
        // Other sessions and tenants are apart; messages joined differently do not match.
        assert_eq!(repeats.repeated(&t, "other", &["a", "b", "c"], 0, false), 0);
        let u = TenantId::from_credential("u");
        assert_eq!(
            repeats.repeated(&u, "s", &["a", "x", "c", "d", "e", "f", "g"], 0, false),
            0
        );
        assert_eq!(
            repeats.repeated(&t, "other", &["ab", "c", "d"], 0, false),
            0
        );
        // Where the scan memo compared the request with the conversation's previous one, its
        // shared leading messages repeat it, up to the first that differs (a prefix cache
        // serves them), without hashing; the memo finding none falls back to the fingerprint,
        // which a memo-answered request did not leave: nothing repeats then.
        let v = TenantId([9; 16]);
        assert_eq!(
            repeats.repeated(&v, "s", &["a", "b"], 0, false),
            0,
            "nothing before"
        );
        assert_eq!(repeats.repeated(&v, "s", &["a", "b", "c"], 2, false), 2);
        assert_eq!(
            repeats.repeated(&v, "s", &["a", "x", "c", "d"], 1, false),
            1,
            "an edit"
        );
        assert_eq!(
            repeats.repeated(&v, "s", &["a", "x", "c", "d"], 9, false),
            4,
            "a retry"
        );
        assert_eq!(
            repeats.repeated(&v, "s", &["a", "x", "c", "d", "e"], 0, false),
            0
        );
        assert_eq!(
            repeats.repeated(&v, "s", &["a", "x", "c", "d", "e", "f"], 0, false),
            5
        );
        // A session not seen before repeats nothing, whatever the memo knows (another
        // conversation's request that opened alike).
        assert_eq!(repeats.repeated(&v, "new", &["a", "x"], 2, false), 0);
        // A request the memo holds is not fingerprinted: the next one learns from the memo,
        // and when the memo has dropped it by then, nothing repeats (an underestimate).
        let w = TenantId([7; 16]);
        assert_eq!(repeats.repeated(&w, "s", &["a", "b"], 0, true), 0);
        assert_eq!(repeats.repeated(&w, "s", &["a", "b", "c"], 2, true), 2);
        assert_eq!(
            repeats.repeated(&w, "s", &["a", "b", "c", "d"], 0, false),
            0
        );
        // Once fingerprinted (the memo could not hold it), the next request is compared with
        // it even when the memo holds that one.
        assert_eq!(
            repeats.repeated(&w, "s", &["a", "b", "c", "d", "e"], 0, true),
            4
        );
    }

    #[test]
    fn caches_serve_prefixes_from_the_minimum_in_steps() {
        assert_eq!(cached_prefix(1_023), 0);
        assert_eq!(cached_prefix(1_024), 1_024);
        assert_eq!(cached_prefix(1_300), 1_280);
    }

    #[test]
    fn without_compactor_the_received_request_is_priced_as_the_actual_one_scales() {
        // Sent 10k estimated, billed 12k input: the 40k-token original would have billed 48k,
        // 30k of it (36k billed) repeating the previous request.
        let usage = Usage {
            input: 12_000,
            output: 1_000,
            cache_read: 0,
            cache_write: 0,
        };
        let bill = without_compactor(&GPT_5, false, (40_000, 30_000), 10_000, &usage, None);
        assert!(close(bill.input, 12_000.0 * 1.25e-6), "{bill:?}");
        assert!(close(bill.cache_read, 36_000.0 * 0.125e-6), "{bill:?}");
        assert!(close(bill.output, 1_000.0 * 10e-6));
        // Anthropic: the new part is written to the cache.
        let bill = without_compactor(&SONNET, true, (40_000, 30_000), 10_000, &usage, None);
        assert!(close(bill.input, 0.0) && close(bill.cache_write, 12_000.0 * 3.75e-6));
        // With the model's ratio learned (1.0 over its requests), the 30k left out count at
        // it: 42k billed, three quarters of it (31.5k) repeating the previous request.
        let bill = without_compactor(&GPT_5, false, (40_000, 30_000), 10_000, &usage, Some(1.0));
        assert!(close(bill.input, 10_500.0 * 1.25e-6), "{bill:?}");
        assert!(close(bill.cache_read, 31_500.0 * 0.125e-6), "{bill:?}");
        // Nothing left out: exactly what was billed, whatever the ratio.
        let bill = without_compactor(&GPT_5, false, (10_000, 0), 10_000, &usage, Some(3.0));
        assert!(close(bill.input, 12_000.0 * 1.25e-6), "{bill:?}");
    }

    #[test]
    fn more_cached_than_input_prices_no_negative_input() {
        let usage = Usage {
            input: 100,
            output: 0,
            cache_read: 150,
            cache_write: 0,
        };
        let bill = Bill::of(&usage, &GPT_5);
        assert!(close(bill.input, 0.0));
        assert!(bill.total() > 0.0);
    }
}
