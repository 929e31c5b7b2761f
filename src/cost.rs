//! What a request cost: a model's [`Price`] applied to the provider's [`Usage`].
//!
//! Providers bill input read from their prompt cache and input written to it apart from the
//! rest: OpenAI reads cached input at a discount and charges nothing extra to write it;
//! Anthropic reads at a tenth of the input price and writes at a premium. [`Usage`] is already
//! normalised (its `input` counts every input token, cached and cache-written ones included),
//! so one rule prices both: the input not read from or written to the cache at `input`, the
//! rest at `cache_read` and `cache_write`, the output at `output`. A model whose table entry
//! names no price has no [`Bill`]: no figure rather than a zero that would read as a saving.

use crate::config::Price;
use crate::usage::Usage;

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
