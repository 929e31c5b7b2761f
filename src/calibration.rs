//! Calibration: how far the character-based estimate is from the provider's real count, per
//! model.
//!
//! compactor estimates tokens from fixed weights per character class, fitted against one
//! tokenizer (see [`crate::estimate`]); real tokenizers differ by model. Each response's
//! `usage` (read by the `usage` module) gives the actual input tokens of the forwarded
//! request; [`Calibration`] keeps, per model, an exponentially weighted mean of
//! `actual ÷ estimated` and hands it out as a [`Calibration::factor`] to multiply estimates by.
//!
//! - Observations must pair the *raw* (uncalibrated) estimate with the actual count, so the
//!   factor never feeds back into itself.
//! - The mean starts at the first observation, then moves by [`ALPHA`] per observation; it is
//!   clamped to [[`MIN_FACTOR`], [`MAX_FACTOR`]] so one odd response (an image-heavy request,
//!   a provider bug) cannot make the trigger absurd.
//! - Requests smaller than [`MIN_TOKENS`] are ignored: fixed per-request overhead dominates
//!   their ratio.
//! - At most [`DEFAULT_CAPACITY`] models are tracked (model names come from clients); when
//!   full, the least recently observed model is forgotten. Names are cut to
//!   [`MAX_MODEL_LEN`] bytes.
//!
//! The lock is a plain mutex held for a hash-map lookup, never across an await.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// Weight of the newest observation in the moving mean.
pub const ALPHA: f64 = 0.2;

/// Smallest factor handed out.
pub const MIN_FACTOR: f64 = 0.25;

/// Largest factor handed out.
pub const MAX_FACTOR: f64 = 4.0;

/// Models tracked at most by [`Calibration::new`].
pub const DEFAULT_CAPACITY: usize = 256;

/// Observations where the estimate or the actual count is below this are ignored.
pub const MIN_TOKENS: u64 = 32;

/// Longest model name kept as a key (longer names are cut at a character boundary).
pub const MAX_MODEL_LEN: usize = 128;

/// Per-model moving ratio of actual ÷ estimated input tokens.
#[derive(Debug)]
pub struct Calibration {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    models: HashMap<String, Entry, foldhash::fast::RandomState>,
    /// Logical clock for least-recently-observed eviction.
    tick: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    ratio: f64,
    samples: u64,
    last_seen: u64,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration::new()
    }
}

impl Calibration {
    /// Tracks up to [`DEFAULT_CAPACITY`] models.
    pub fn new() -> Calibration {
        Calibration::with_capacity(DEFAULT_CAPACITY)
    }

    /// Tracks up to `capacity` models (at least one).
    pub fn with_capacity(capacity: usize) -> Calibration {
        Calibration {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Records one response: `estimated` is the raw estimate of the forwarded request's input
    /// tokens, `actual` the input tokens the provider reported. Ignores tiny requests.
    pub fn observe(&self, model: &str, estimated: u64, actual: u64) {
        if estimated < MIN_TOKENS || actual < MIN_TOKENS {
            return;
        }
        let sample = (actual as f64 / estimated as f64).clamp(MIN_FACTOR, MAX_FACTOR);
        let key = key(model);
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(entry) = inner.models.get_mut(key) {
            entry.ratio =
                (entry.ratio + ALPHA * (sample - entry.ratio)).clamp(MIN_FACTOR, MAX_FACTOR);
            entry.samples = entry.samples.saturating_add(1);
            entry.last_seen = tick;
            return;
        }
        if inner.models.len() >= self.capacity {
            let oldest = inner
                .models
                .iter()
                .min_by_key(|(_, e)| e.last_seen)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                inner.models.remove(&oldest);
            }
        }
        inner.models.insert(
            key.to_owned(),
            Entry {
                ratio: sample,
                samples: 1,
                last_seen: tick,
            },
        );
    }

    /// The factor to multiply `model`'s estimates by: 1.0 for a model never observed.
    pub fn factor(&self, model: &str) -> f64 {
        self.lock().models.get(key(model)).map_or(1.0, |e| e.ratio)
    }

    /// Observations recorded for `model` (0 when unknown).
    pub fn samples(&self, model: &str) -> u64 {
        self.lock().models.get(key(model)).map_or(0, |e| e.samples)
    }

    /// Models tracked.
    pub fn len(&self) -> usize {
        self.lock().models.len()
    }

    /// Whether no model is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain numbers behind; keep using them.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The model name cut to [`MAX_MODEL_LEN`] bytes at a character boundary.
fn key(model: &str) -> &str {
    if model.len() <= MAX_MODEL_LEN {
        return model;
    }
    let mut end = MAX_MODEL_LEN;
    while !model.is_char_boundary(end) {
        end -= 1;
    }
    &model[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_is_one() {
        let c = Calibration::new();
        assert_eq!(c.factor("gpt-4o"), 1.0);
        assert!(c.is_empty());
    }

    #[test]
    fn converges_towards_the_true_ratio() {
        let c = Calibration::new();
        // The first observation is noisy; the true ratio is 1.3.
        c.observe("m", 1000, 2000);
        assert!((c.factor("m") - 2.0).abs() < 1e-9);
        let mut previous_gap = (c.factor("m") - 1.3).abs();
        for i in 0..40 {
            c.observe("m", 1000, 1300);
            let gap = (c.factor("m") - 1.3).abs();
            assert!(
                gap < previous_gap,
                "step {i}: gap {gap} not below {previous_gap}"
            );
            previous_gap = gap;
        }
        assert!(previous_gap < 0.001, "{}", c.factor("m"));
        assert_eq!(c.samples("m"), 41);
        // Each step moves by ALPHA of the gap.
        let c = Calibration::new();
        c.observe("m", 1000, 1000);
        c.observe("m", 1000, 2000);
        assert!((c.factor("m") - (1.0 + ALPHA * 1.0)).abs() < 1e-9);
    }

    #[test]
    fn models_are_independent() {
        let c = Calibration::new();
        c.observe("a", 1000, 500);
        c.observe("b", 1000, 1500);
        assert!((c.factor("a") - 0.5).abs() < 1e-9);
        assert!((c.factor("b") - 1.5).abs() < 1e-9);
        assert_eq!(c.factor("c"), 1.0);
    }

    #[test]
    fn clamped() {
        let c = Calibration::new();
        c.observe("low", 1_000_000, 100);
        assert_eq!(c.factor("low"), MIN_FACTOR);
        c.observe("high", 100, 1_000_000);
        assert_eq!(c.factor("high"), MAX_FACTOR);
        for _ in 0..100 {
            c.observe("high", 100, u64::MAX);
        }
        assert_eq!(c.factor("high"), MAX_FACTOR);
    }

    #[test]
    fn tiny_requests_are_ignored() {
        let c = Calibration::new();
        c.observe("m", MIN_TOKENS - 1, 1000);
        c.observe("m", 1000, MIN_TOKENS - 1);
        c.observe("m", 0, 0);
        assert_eq!(c.factor("m"), 1.0);
        assert!(c.is_empty());
    }

    #[test]
    fn bounded_size_forgets_the_least_recently_observed() {
        let c = Calibration::with_capacity(3);
        c.observe("a", 100, 200);
        c.observe("b", 100, 300);
        c.observe("c", 100, 400);
        c.observe("a", 100, 200); // a is now the most recent; b the oldest
        c.observe("d", 100, 50);
        assert_eq!(c.len(), 3);
        assert_eq!(c.factor("b"), 1.0, "b was the least recently observed");
        assert!((c.factor("a") - 2.0).abs() < 1e-9);
        assert!((c.factor("d") - 0.5).abs() < 1e-9);

        let c = Calibration::new();
        for i in 0..(DEFAULT_CAPACITY * 4) {
            c.observe(&format!("model-{i}"), 1000, 1100);
        }
        assert_eq!(c.len(), DEFAULT_CAPACITY);
        let newest = format!("model-{}", DEFAULT_CAPACITY * 4 - 1);
        assert!((c.factor(&newest) - 1.1).abs() < 1e-9);
    }

    #[test]
    fn long_model_names_share_a_bounded_key() {
        let c = Calibration::new();
        let long = "é".repeat(200); // 400 bytes, multi-byte characters
        c.observe(&long, 1000, 2000);
        assert!((c.factor(&long) - 2.0).abs() < 1e-9);
        assert!(key(&long).len() <= MAX_MODEL_LEN);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn shared_between_threads() {
        let c = std::sync::Arc::new(Calibration::new());
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        c.observe(&format!("m{t}"), 1000, 1500);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("thread");
        }
        assert_eq!(c.len(), 4);
        for t in 0..4 {
            assert_eq!(c.samples(&format!("m{t}")), 100);
            assert!((c.factor(&format!("m{t}")) - 1.5).abs() < 1e-9);
        }
    }
}
