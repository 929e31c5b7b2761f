//! How fast conversations grow, and how long a summary takes to write: what starting a
//! background summary early enough needs.
//!
//! A background summary starts at `compaction.background_ratio` of the trigger. In a small
//! window, or with a slow summarizer, a conversation crosses from there to the trigger in fewer
//! turns than a summary takes, and the request that crosses waits for it. So each conversation's
//! growth per request (estimated tokens and messages, and the time between requests) is
//! followed, and so is the summarizer's latency; the summary starts when the conversation is
//! predicted to reach the trigger before a summary started now would be ready, with one turn to
//! spare. Until a summary has been timed, for a conversation's first request, while summaries
//! take less than [`QUICK_SUMMARY`] (a local summarizer: ready before the next turn), and for a
//! conversation whose requests come faster than [`QUICK_TURN`] (no model answers between them:
//! a script, a replay, a test), nothing is predicted: the plain watermark applies. The last
//! rule also keeps fast back-to-back traffic from being told to summarise at half the trigger
//! because one summary on a loaded machine took a few hundred milliseconds.
//!
//! What is followed is this process's view: a replica sees the requests routed to it, which
//! only makes its turns look longer and its start later. The map is bounded and forgotten all
//! at once when full (at worst one conversation starts at the plain watermark again).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Conversations followed at most.
const MAX_FOLLOWED: usize = 16_384;
/// Weight of the newest observation in the running averages.
const NEWEST: f64 = 0.5;
/// A summary written this fast is ready before an agent's next request (each waits on a
/// model's answer): no lead is needed.
pub const QUICK_SUMMARY: Duration = Duration::from_millis(500);
/// Requests closer together than this on average are not an agent waiting on a model between
/// them: their pace predicts nothing.
pub const QUICK_TURN: Duration = Duration::from_millis(100);

/// What a conversation is predicted to add while a summary is written: start it this much
/// before the trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lead {
    /// Estimated tokens.
    pub tokens: usize,
    /// Messages.
    pub messages: usize,
}

/// One conversation's growth so far.
#[derive(Debug, Clone, Copy)]
struct Growth {
    tokens: usize,
    messages: usize,
    at: Instant,
    /// Running averages per request: estimated tokens, messages and seconds added.
    per_turn: Option<(f64, f64, f64)>,
}

/// Growth of every followed conversation and the summarizer's latency.
#[derive(Debug, Default)]
pub struct Pace {
    /// Predicts nothing ([`Pace::off`]).
    off: bool,
    conversations: Mutex<HashMap<u64, Growth, foldhash::fast::RandomState>>,
    /// Fingerprints conversation keys (foldhash, seeded per process: a lookup per request).
    keys: foldhash::fast::RandomState,
    /// Running average of a summary's duration, in seconds.
    summary_secs: Mutex<Option<f64>>,
}

impl Pace {
    /// A pace that predicts nothing: for a caller whose summaries are ready before the next
    /// request by construction (the replay awaits each one), where timing them with this
    /// machine's clock would only make the result depend on its speed.
    pub fn off() -> Pace {
        Pace {
            off: true,
            ..Pace::default()
        }
    }

    /// A summary took `took` to write.
    pub fn summary_took(&self, took: Duration) {
        let mut secs = self
            .summary_secs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *secs = Some(average(*secs, took.as_secs_f64()));
    }

    /// Records a request of conversation `key` holding `messages` messages and `tokens`
    /// estimated tokens at `now`, and returns how much the conversation is predicted to grow
    /// while a summary started now is written (one turn more than the summary takes, rounded
    /// up), once both its growth and a summary's duration are known. A request no larger than
    /// the last one (a retry, or an edit that shortened the conversation) starts the following
    /// again.
    pub fn observe(
        &self,
        key: &impl Hash,
        messages: usize,
        tokens: usize,
        now: Instant,
    ) -> Option<Lead> {
        if self.off {
            return None;
        }
        let summary_secs = *self
            .summary_secs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let key = self.keys.hash_one(key);
        let mut conversations = self
            .conversations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if conversations.len() >= MAX_FOLLOWED && !conversations.contains_key(&key) {
            conversations.clear();
        }
        let fresh = Growth {
            tokens,
            messages,
            at: now,
            per_turn: None,
        };
        let growth = conversations.entry(key).or_insert(fresh);
        let grew = tokens > growth.tokens && messages >= growth.messages;
        if !grew {
            // The same request again, or a shorter conversation: nothing to learn from it.
            if tokens < growth.tokens || messages < growth.messages {
                *growth = fresh;
            }
            return lead(growth.per_turn, summary_secs);
        }
        let added = (
            (tokens - growth.tokens) as f64,
            (messages - growth.messages) as f64,
            now.saturating_duration_since(growth.at).as_secs_f64(),
        );
        let per_turn = match growth.per_turn {
            None => added,
            Some((t, m, s)) => (
                average(Some(t), added.0),
                average(Some(m), added.1),
                average(Some(s), added.2),
            ),
        };
        *growth = Growth {
            tokens,
            messages,
            at: now,
            per_turn: Some(per_turn),
        };
        lead(growth.per_turn, summary_secs)
    }
}

/// The growth while a summary of `summary_secs` is written, one turn to spare.
fn lead(per_turn: Option<(f64, f64, f64)>, summary_secs: Option<f64>) -> Option<Lead> {
    let (tokens, messages, turn_secs) = per_turn?;
    let summary_secs = summary_secs.filter(|s| *s >= QUICK_SUMMARY.as_secs_f64())?;
    if turn_secs < QUICK_TURN.as_secs_f64() {
        return None;
    }
    let turns = (summary_secs / turn_secs).ceil() + 1.0;
    // `as` saturates.
    Some(Lead {
        tokens: (tokens * turns).ceil() as usize,
        messages: (messages * turns).ceil() as usize,
    })
}

fn average(old: Option<f64>, new: f64) -> f64 {
    match old {
        None => new,
        Some(old) => old + NEWEST * (new - old),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_predicted_before_a_summary_is_timed_and_the_conversation_has_grown() {
        let pace = Pace::default();
        let t0 = Instant::now();
        assert_eq!(pace.observe(&"a", 4, 1_000, t0), None, "first request");
        let one = t0 + Duration::from_millis(500);
        assert_eq!(
            pace.observe(&"a", 6, 1_400, one),
            None,
            "no summary timed yet"
        );
        pace.summary_took(Duration::from_secs(4));
        // 400 tokens and 2 messages every half second; a summary takes 8 turns, plus one.
        let two = one + Duration::from_millis(500);
        assert_eq!(
            pace.observe(&"a", 8, 1_800, two),
            Some(Lead {
                tokens: 3_600,
                messages: 18
            })
        );
        // Another conversation has no growth of its own yet.
        assert_eq!(pace.observe(&"b", 8, 1_800, two), None);
    }

    #[test]
    fn averages_follow_the_conversation_and_a_shorter_one_starts_again() {
        let pace = Pace::default();
        pace.summary_took(Duration::from_secs(2));
        pace.summary_took(Duration::from_secs(4)); // 3 s on average
        let t0 = Instant::now();
        pace.observe(&"a", 2, 100, t0);
        pace.observe(&"a", 4, 300, t0 + Duration::from_secs(1)); // +200 in 1 s
        let lead = pace.observe(&"a", 6, 700, t0 + Duration::from_secs(2)); // +400 in 1 s
                                                                            // 300 tokens a turn on average, one turn a second: 3 turns and one to spare.
        assert_eq!(
            lead,
            Some(Lead {
                tokens: 1_200,
                messages: 8
            })
        );
        // The same request again teaches nothing and keeps the prediction.
        assert_eq!(
            pace.observe(&"a", 6, 700, t0 + Duration::from_secs(3)),
            lead
        );
        // A shorter conversation (an edit) starts the following again.
        assert_eq!(
            pace.observe(&"a", 3, 200, t0 + Duration::from_secs(4)),
            None
        );
    }

    #[test]
    fn a_quick_summarizer_needs_no_lead() {
        let pace = Pace::default();
        pace.summary_took(Duration::from_millis(400));
        let t0 = Instant::now();
        pace.observe(&"a", 2, 100, t0);
        assert_eq!(
            pace.observe(&"a", 4, 200, t0 + Duration::from_secs(1)),
            None
        );
    }

    #[test]
    fn a_pace_that_is_off_predicts_nothing() {
        let pace = Pace::off();
        pace.summary_took(Duration::from_secs(4));
        let t0 = Instant::now();
        pace.observe(&"a", 2, 100, t0);
        assert_eq!(
            pace.observe(&"a", 4, 200, t0 + Duration::from_secs(1)),
            None
        );
    }

    #[test]
    fn requests_faster_than_a_model_answers_predict_nothing() {
        let pace = Pace::default();
        pace.summary_took(Duration::from_secs(4));
        let t0 = Instant::now();
        pace.observe(&"a", 2, 100, t0);
        assert_eq!(pace.observe(&"a", 4, 200, t0), None, "a burst");
        assert_eq!(
            pace.observe(&"a", 6, 300, t0 + Duration::from_millis(50)),
            None,
            "still faster than a model, on average"
        );
        // Slower turns bring the average over the bound: now a lead is predicted.
        pace.observe(&"a", 8, 400, t0 + Duration::from_secs(1));
        let lead = pace.observe(&"a", 10, 500, t0 + Duration::from_secs(2));
        assert!(lead.is_some_and(|l| l.messages > 2), "{lead:?}");
    }
}
