//! The per-session breaker: a conversation whose compactions keep failing stops
//! compacting for a while instead of paying for a failing summarizer on every request.
//!
//! After [`SESSION_BREAKER_THRESHOLD`] consecutive failures the breaker opens: no automatic
//! compaction for the cooldown. Then it is half-open: the next attempt runs (one at a time);
//! success closes and resets it, failure opens it again for another cooldown. It is pure logic
//! over an injected [`Instant`], so tests never sleep; the store keeps one per session entry.

use std::time::{Duration, Instant};

use serde::Serialize;

/// Consecutive failed compactions that open a session's breaker.
pub const SESSION_BREAKER_THRESHOLD: u32 = 3;

/// What a breaker currently lets through, as shown by the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Compactions run.
    Closed,
    /// Compactions are skipped until the cooldown ends.
    Open,
    /// The cooldown ended: one trial compaction may run (or is running).
    HalfOpen,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Closed,
    Open {
        since: Instant,
    },
    /// A trial was let through at `since`; another is allowed only if it never reports back
    /// within a cooldown (its request was cancelled), so an abandoned trial cannot wedge the
    /// breaker half-open forever.
    Trial {
        since: Instant,
    },
}

/// One session's breaker. See the module docs for the state machine.
#[derive(Debug, Clone)]
pub struct Breaker {
    cooldown: Duration,
    failures: u32,
    phase: Phase,
}

impl Breaker {
    /// A closed breaker that stays open for `cooldown` once tripped.
    pub fn new(cooldown: Duration) -> Breaker {
        Breaker {
            cooldown,
            failures: 0,
            phase: Phase::Closed,
        }
    }

    /// Whether an automatic compaction may run at `now`. In the half-open state this lets
    /// exactly one attempt through and records it as the trial.
    pub fn allow(&mut self, now: Instant) -> bool {
        match self.phase {
            Phase::Closed => true,
            Phase::Open { since } | Phase::Trial { since } => {
                if now.saturating_duration_since(since) >= self.cooldown {
                    self.phase = Phase::Trial { since: now };
                    true
                } else {
                    false
                }
            }
        }
    }

    /// A compaction succeeded: close and reset.
    pub fn record_success(&mut self) {
        self.failures = 0;
        self.phase = Phase::Closed;
    }

    /// A compaction failed at `now`. Returns true when this failure opened the breaker (the
    /// threshold was reached, or a half-open trial failed).
    pub fn record_failure(&mut self, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        match self.phase {
            Phase::Closed if self.failures >= SESSION_BREAKER_THRESHOLD => {
                self.phase = Phase::Open { since: now };
                true
            }
            Phase::Closed => false,
            Phase::Trial { .. } => {
                self.phase = Phase::Open { since: now };
                true
            }
            // A failure reported while open (e.g. a manual compaction) does not extend it.
            Phase::Open { .. } => false,
        }
    }

    /// The state at `now`, without letting anything through.
    pub fn state(&self, now: Instant) -> BreakerState {
        match self.phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { since } if now.saturating_duration_since(since) < self.cooldown => {
                BreakerState::Open
            }
            Phase::Open { .. } | Phase::Trial { .. } => BreakerState::HalfOpen,
        }
    }

    /// Failures since the last success.
    pub fn consecutive_failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOLDOWN: Duration = Duration::from_secs(60);

    fn tripped(t0: Instant) -> Breaker {
        let mut b = Breaker::new(COOLDOWN);
        assert!(!b.record_failure(t0));
        assert!(!b.record_failure(t0));
        assert!(b.record_failure(t0), "the third failure opens it");
        b
    }

    #[test]
    fn opens_after_three_consecutive_failures() {
        let t0 = Instant::now();
        let mut b = Breaker::new(COOLDOWN);
        assert!(b.allow(t0));
        assert!(!b.record_failure(t0));
        assert!(!b.record_failure(t0));
        assert!(b.allow(t0), "still closed after two");
        assert_eq!(b.state(t0), BreakerState::Closed);
        assert!(b.record_failure(t0));
        assert_eq!(b.state(t0), BreakerState::Open);
        assert!(!b.allow(t0));
        assert!(!b.allow(t0 + COOLDOWN - Duration::from_millis(1)));
        assert_eq!(b.consecutive_failures(), 3);
    }

    #[test]
    fn success_in_between_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(COOLDOWN);
        assert!(!b.record_failure(t0));
        assert!(!b.record_failure(t0));
        b.record_success();
        assert!(!b.record_failure(t0));
        assert!(!b.record_failure(t0));
        assert!(b.allow(t0));
        assert_eq!(b.state(t0), BreakerState::Closed);
    }

    #[test]
    fn closes_after_cooldown_and_a_successful_trial() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let later = t0 + COOLDOWN;
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        assert!(b.allow(later), "half-open lets the next attempt run");
        assert!(!b.allow(later), "only one trial at a time");
        b.record_success();
        assert_eq!(b.state(later), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 0);
        assert!(b.allow(later));
        // Reset: it takes three fresh failures to open again.
        assert!(!b.record_failure(later));
        assert!(!b.record_failure(later));
        assert!(b.record_failure(later));
    }

    #[test]
    fn half_open_failure_reopens_for_a_full_cooldown() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let t1 = t0 + COOLDOWN + Duration::from_secs(5);
        assert!(b.allow(t1));
        assert!(b.record_failure(t1), "a failed trial re-opens");
        assert_eq!(b.state(t1), BreakerState::Open);
        assert!(!b.allow(t1 + COOLDOWN - Duration::from_millis(1)));
        assert!(b.allow(t1 + COOLDOWN));
    }

    #[test]
    fn an_abandoned_trial_is_retried_after_a_cooldown() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        let t1 = t0 + COOLDOWN;
        assert!(b.allow(t1));
        // The trial never reports back.
        assert!(!b.allow(t1 + COOLDOWN / 2));
        assert!(b.allow(t1 + COOLDOWN));
    }

    #[test]
    fn failure_while_open_does_not_extend_it() {
        let t0 = Instant::now();
        let mut b = tripped(t0);
        assert!(!b.record_failure(t0 + COOLDOWN / 2));
        assert!(b.allow(t0 + COOLDOWN));
    }
}
