//! Token estimation without a tokenizer (docs/architecture.md, *Token estimate*).
//!
//! compactor estimates 0.25 tokens per character (about four characters per token) over
//! everything the model reads: message text, tool-call names and arguments, tool outputs,
//! reasoning, the system prompt and tool definitions, plus a fixed cost per image. Characters
//! are Unicode scalar values, never bytes, so non-Latin text is not over-counted fourfold.
//! Estimates are rounded up per message, so the estimate of a request is the sum of the
//! estimates of its messages plus that of its tool definitions. Dialects count what a message
//! holds into [`Counts`]; this module turns counts into tokens. What a neutral message holds is
//! counted by [`crate::transcript`], which builds on this module.

/// Default tokens per character: ~4 characters per token for English text and code.
pub const TOKENS_PER_CHAR: f64 = 0.25;

/// Estimated tokens of one image.
///
/// An image's token cost depends on its size and detail level, which compactor cannot see
/// without downloading or decoding it. 765 is what OpenAI charges for a 1024×1024 image at
/// `detail: high` (85 base tokens + 4 tiles × 170), a common screenshot size; Anthropic's
/// formula (width × height / 750) gives ~1,400 for the same image and caps near 1,600. A
/// fixed value keeps the estimate cheap and deterministic; it errs low for large images,
/// which the trigger ratio's headroom absorbs.
pub const IMAGE_TOKENS: usize = 765;

/// What a message (or any piece of a request) holds, as far as the estimate cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Characters the model reads.
    pub chars: usize,
    /// Images the model sees.
    pub images: usize,
}

impl Counts {
    /// Adds another count to this one.
    pub fn add(&mut self, other: Counts) {
        self.chars = self.chars.saturating_add(other.chars);
        self.images = self.images.saturating_add(other.images);
    }
}

/// A token estimator at a fixed tokens-per-character ratio: cheap enough for every request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LazyEstimator {
    tokens_per_char: f64,
}

impl Default for LazyEstimator {
    fn default() -> Self {
        LazyEstimator {
            tokens_per_char: TOKENS_PER_CHAR,
        }
    }
}

impl LazyEstimator {
    /// An estimator with a custom ratio (e.g. calibrated from real `usage`); non-finite or
    /// non-positive ratios fall back to [`TOKENS_PER_CHAR`].
    pub fn new(tokens_per_char: f64) -> Self {
        let tokens_per_char = if tokens_per_char.is_finite() && tokens_per_char > 0.0 {
            tokens_per_char
        } else {
            TOKENS_PER_CHAR
        };
        LazyEstimator { tokens_per_char }
    }

    /// Tokens of `chars` characters, rounded up.
    pub fn chars(&self, chars: usize) -> usize {
        // `as` saturates at `usize::MAX`.
        (chars as f64 * self.tokens_per_char).ceil() as usize
    }

    /// Tokens of a piece of text.
    pub fn text(&self, text: &str) -> usize {
        self.chars(count_chars(text))
    }

    /// Tokens of counted content: characters plus [`IMAGE_TOKENS`] per image.
    pub fn counts(&self, counts: Counts) -> usize {
        self.chars(counts.chars)
            .saturating_add(counts.images.saturating_mul(IMAGE_TOKENS))
    }

    /// The characters a model that could fit `tokens` tokens would read (inverse of
    /// [`LazyEstimator::chars`], rounded down).
    pub fn chars_for_tokens(&self, tokens: usize) -> usize {
        (tokens as f64 / self.tokens_per_char).floor() as usize
    }
}

/// Unicode scalar values in `s`, counted as the bytes that do not continue a UTF-8 sequence
/// (branch-free, so it vectorises; much cheaper than decoding).
pub fn count_chars(s: &str) -> usize {
    let bytes = s.as_bytes();
    // Most text an agent sends is ASCII: one word-at-a-time check and the length is the answer.
    if bytes.is_ascii() {
        return bytes.len();
    }
    // Counted in byte lanes per 64-byte chunk (a chunk holds at most 64, so a `u8` cannot
    // overflow): summing straight into `usize` makes the compiler widen every lane to 64 bits
    // and process a few bytes per step.
    let continuation: usize = bytes
        .chunks(64)
        .map(|chunk| {
            let n: u8 = chunk
                .iter()
                .map(|&b| u8::from((b as i8) < -0x40))
                .fold(0, |acc, x| acc.wrapping_add(x));
            usize::from(n)
        })
        .sum();
    bytes.len() - continuation
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarter_token_per_char_is_the_default() {
        assert_eq!(TOKENS_PER_CHAR, 0.25);
        let e = LazyEstimator::default();
        assert_eq!(e.chars(0), 0);
        assert_eq!(e.chars(4), 1);
        assert_eq!(e.chars(5), 2, "rounded up");
        assert_eq!(e.text(&"x".repeat(4000)), 1000);
    }

    #[test]
    fn image_cost_is_fixed_and_documented() {
        assert_eq!(IMAGE_TOKENS, 765);
        let e = LazyEstimator::default();
        assert_eq!(
            e.counts(Counts {
                chars: 8,
                images: 2
            }),
            2 + 2 * 765
        );
    }

    #[test]
    fn characters_not_bytes_are_counted() {
        assert_eq!(count_chars("héllo"), 5);
        assert_eq!(count_chars("日本語"), 3);
        assert_eq!(count_chars("🦀🦀"), 2);
        assert_eq!(count_chars(""), 0);
        let e = LazyEstimator::default();
        assert_eq!(e.text("日本語日"), 1, "4 chars (12 bytes) are one token");
        // Long mixed text crosses the 64-byte chunks at every offset.
        for prefix in 0..70 {
            let s = format!("{}{}", "a".repeat(prefix), "é日🦀x".repeat(50));
            assert_eq!(count_chars(&s), s.chars().count(), "prefix {prefix}");
        }
    }

    #[test]
    fn bad_ratios_fall_back_and_inverse_is_consistent() {
        assert_eq!(LazyEstimator::new(f64::NAN), LazyEstimator::default());
        assert_eq!(LazyEstimator::new(-1.0), LazyEstimator::default());
        let e = LazyEstimator::new(0.5);
        assert_eq!(e.chars(3), 2);
        assert_eq!(LazyEstimator::default().chars_for_tokens(10), 40);
    }
}
