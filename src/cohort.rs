//! Cohorts: which conversations are compacted, which are only watched, and which are left
//! alone, so an operator can roll compactor out and compare.
//!
//! Every chat request falls in one [`Cohort`]: a request's own `x-compactor-mode` header
//! decides first (a client or a gateway opting one request out, or into shadow); else a
//! conversation outside `compaction.sample_ratio` is in the control cohort, forwarded
//! unchanged; else `compaction.mode` decides (`enforce` or `shadow`). The sample is a stable
//! hash of the session id ([`sampled`]), the same on every replica and after every restart, so
//! a conversation never moves between cohorts mid-way (it would lose its summary and its
//! provider cache) unless the ratio changes.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hash};
use std::sync::{Mutex, PoisonError};

use sha2::{Digest, Sha256};

use crate::config::Mode;

/// Conversations remembered at most by [`Conversations`].
const MAX_REMEMBERED: usize = 65_536;

/// Where one request falls: the `cohort` label of the `compactor_cohort_*` metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Cohort {
    /// Compacted: the request forwarded is the compacted one.
    #[default]
    Enforce,
    /// Watched: compaction decided as `enforce` would, the request forwarded as received.
    Shadow,
    /// Outside `compaction.sample_ratio`: forwarded as received, for comparison.
    Control,
    /// Opted out by its `x-compactor-mode: off` header: forwarded as received.
    Off,
}

impl Cohort {
    /// Every cohort, in the order of [`Cohort::index`].
    pub const ALL: [Cohort; 4] = [
        Cohort::Enforce,
        Cohort::Shadow,
        Cohort::Control,
        Cohort::Off,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Cohort::Enforce => "enforce",
            Cohort::Shadow => "shadow",
            Cohort::Control => "control",
            Cohort::Off => "off",
        }
    }

    /// Position in [`Cohort::ALL`] (metric arrays are indexed by it).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The cohort of a request of conversation `session`: its header's mode if it sent one,
    /// else the control cohort outside `sample_ratio`, else the configured mode.
    pub fn of(header: Option<Mode>, mode: Mode, sample_ratio: f64, session: &str) -> Cohort {
        let mode = match header {
            Some(m) => m,
            None if !sampled(session, sample_ratio) => return Cohort::Control,
            None => mode,
        };
        match mode {
            Mode::Enforce => Cohort::Enforce,
            Mode::Shadow => Cohort::Shadow,
            Mode::Off => Cohort::Off,
        }
    }

    /// Whether requests of this cohort are forwarded compacted.
    pub fn compacts(self) -> bool {
        self == Cohort::Enforce
    }
}

/// Whether conversation `session` is in the sample of `ratio` (0.0 to 1.0) of all
/// conversations: the first 8 bytes of the SHA-256 of its id, read as a fraction of 2^64,
/// are below `ratio`. Stable across processes, machines and releases; 1.0 takes every
/// conversation and 0.0 none.
pub fn sampled(session: &str, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let digest = Sha256::digest(session.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    // The top 53 bits, as many as an f64 holds exactly.
    let fraction = (u64::from_be_bytes(first) >> 11) as f64 / (1u64 << 53) as f64;
    fraction < ratio
}

/// The conversations this process has seen, so each is counted once
/// (`compactor_cohort_conversations_total`). Bounded: forgotten all at once when full, when a
/// conversation still going is counted a second time.
#[derive(Debug, Default)]
pub struct Conversations {
    seen: Mutex<HashSet<u64, foldhash::fast::RandomState>>,
    /// Fingerprints conversation keys (foldhash, seeded per process: a lookup per request).
    keys: foldhash::fast::RandomState,
}

impl Conversations {
    /// Whether this is the first request of conversation `key` seen (and remembers it).
    pub fn first(&self, key: &impl Hash) -> bool {
        let key = self.keys.hash_one(key);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.len() >= MAX_REMEMBERED {
            seen.clear();
        }
        seen.insert(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sample_is_stable_and_matches_the_ratio() {
        let ids: Vec<String> = (0..20_000).map(|i| format!("{i:016x}")).collect();
        for ratio in [0.0, 0.1, 0.5, 0.9, 1.0] {
            let taken = ids.iter().filter(|id| sampled(id, ratio)).count();
            let share = taken as f64 / ids.len() as f64;
            assert!((share - ratio).abs() < 0.01, "ratio {ratio}: took {share}");
        }
        // Nested: raising the ratio only adds conversations, never moves one out.
        for id in &ids {
            assert!(!sampled(id, 0.1) || sampled(id, 0.5), "{id}");
        }
        // Fixed by the id alone: these values are what every replica and release computes.
        assert!(sampled("5bbab3b4234545b3", 0.5) == sampled("5bbab3b4234545b3", 0.5));
        let known: Vec<bool> = ["a", "b", "c", "d"]
            .iter()
            .map(|id| sampled(id, 0.5))
            .collect();
        assert_eq!(known, first_bits_below_half(&["a", "b", "c", "d"]));
    }

    /// The same decision computed independently: the digest's top bit is 0.
    fn first_bits_below_half(ids: &[&str]) -> Vec<bool> {
        ids.iter()
            .map(|id| Sha256::digest(id.as_bytes())[0] < 0x80)
            .collect()
    }

    #[test]
    fn the_header_decides_first_then_the_sample_then_the_mode() {
        let out = (0..1000)
            .map(|i| i.to_string())
            .find(|id| !sampled(id, 0.5))
            .expect("some id outside half");
        assert_eq!(Cohort::of(None, Mode::Enforce, 0.5, &out), Cohort::Control);
        assert_eq!(
            Cohort::of(Some(Mode::Enforce), Mode::Shadow, 0.5, &out),
            Cohort::Enforce
        );
        assert_eq!(
            Cohort::of(Some(Mode::Off), Mode::Enforce, 1.0, &out),
            Cohort::Off
        );
        assert_eq!(Cohort::of(None, Mode::Shadow, 1.0, &out), Cohort::Shadow);
        assert_eq!(Cohort::of(None, Mode::Enforce, 1.0, &out), Cohort::Enforce);
        assert_eq!(Mode::from_header(" Shadow "), Some(Mode::Shadow));
        assert_eq!(Mode::from_header("maybe"), None);
    }
}
