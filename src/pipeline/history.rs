//! What each conversation's recent requests looked like, for the session inspector page
//! (`/ui`) and `GET /session/{id}/requests`: per request, when it came, its estimated tokens as
//! received and as forwarded, the token trigger it was checked against, and what was done to
//! it (a new summary, a stored one spliced in, outputs masked, a refusal for length compacted
//! and sent again, a failed compaction).
//!
//! This process's view, in memory: a replica sees the requests routed to it. Bounded: the
//! latest [`MAX_POINTS`] requests of each conversation, at most [`MAX_SESSIONS`]
//! conversations (forgotten all at once when full, as `pace` does).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Requests kept per conversation.
pub const MAX_POINTS: usize = 500;
/// Conversations followed at most.
pub const MAX_SESSIONS: usize = 4_096;

/// What was done to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Done {
    /// Forwarded as received.
    Unchanged,
    /// A new summary replaced older turns.
    Compacted,
    /// A stored summary was spliced in.
    Reused,
    /// Old tool outputs were masked (no summary).
    Masked,
    /// A refusal for length was compacted and sent again.
    Retried,
    /// A compaction was due and failed: forwarded without a new summary.
    Failed,
}

/// One request of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// When it came, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Estimated input tokens as received.
    pub received: usize,
    /// Estimated input tokens as forwarded.
    pub forwarded: usize,
    /// The token trigger it was checked against (estimated tokens).
    pub trigger: usize,
    /// What was done to it.
    pub done: Done,
    /// The number of the summary it carries (0: none).
    pub summary: u32,
}

impl Point {
    /// A point stamped now.
    pub fn now(
        received: usize,
        forwarded: usize,
        trigger: usize,
        done: Done,
        summary: u32,
    ) -> Point {
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Point {
            at_ms,
            received,
            forwarded,
            trigger,
            done,
            summary,
        }
    }
}

/// The recent requests of every followed conversation.
#[derive(Debug, Default)]
pub struct History {
    sessions: Mutex<HashMap<String, VecDeque<Point>, foldhash::fast::RandomState>>,
}

impl History {
    /// Adds `point` to `session`'s history.
    pub fn record(&self, session: &str, point: Point) {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        // The id is copied only for a conversation not followed yet (not on every request).
        if let Some(points) = sessions.get_mut(session) {
            if points.len() == MAX_POINTS {
                points.pop_front();
            }
            points.push_back(point);
            return;
        }
        if sessions.len() >= MAX_SESSIONS {
            sessions.clear();
        }
        sessions.insert(session.to_string(), VecDeque::from([point]));
    }

    /// `session`'s recent requests, oldest first.
    pub fn points(&self, session: &str) -> Vec<Point> {
        let sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions
            .get(session)
            .map(|p| p.iter().copied().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_conversation_keeps_its_latest_requests_in_order() {
        let h = History::default();
        for i in 0..MAX_POINTS + 10 {
            h.record("a", Point::now(i, i, 100, Done::Unchanged, 0));
        }
        h.record("b", Point::now(7, 3, 100, Done::Compacted, 1));
        let a = h.points("a");
        assert_eq!(a.len(), MAX_POINTS);
        assert_eq!(a[0].received, 10, "the oldest dropped first");
        assert_eq!(a.last().map(|p| p.received), Some(MAX_POINTS + 9));
        assert_eq!(h.points("b")[0].done, Done::Compacted);
        assert!(h.points("c").is_empty());
        let json = serde_json::to_value(h.points("b")[0]).expect("json");
        assert_eq!(json["done"], "compacted");
        assert_eq!(json["summary"], 1);
    }
}
