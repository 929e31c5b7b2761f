//! `server.max_buffered_bytes`: the chat bodies held in memory at once, across requests.
//!
//! A chat body is read whole to be compacted, and kept until the provider's answer has begun
//! (a refusal for length is retried from it). Under a burst of large bodies that memory adds
//! up; past the budget a request is not refused but streamed upstream as it arrives,
//! uncompacted, and counted. Reservations are plain atomics: no lock on the hot path.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of chat bodies that may be held at once.
#[derive(Debug)]
pub struct BufferBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BufferBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<BufferBudget> {
        Arc::new(BufferBudget {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes that may be held at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// Holds `bytes` of the budget, or `None` when they do not fit.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Option<Held> {
        self.take(bytes).then(|| Held {
            budget: self.clone(),
            bytes,
        })
    }

    fn take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }
}

/// A part of the budget, returned when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl Held {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `more` bytes too; false (holding as before) when they do not fit.
    pub fn grow(&mut self, more: usize) -> bool {
        let grown = self.budget.take(more);
        if grown {
            self.bytes += more;
        }
        grown
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_limit_and_are_returned_when_dropped() {
        let budget = BufferBudget::new(100);
        let a = budget.reserve(60).expect("fits");
        assert!(budget.reserve(41).is_none(), "over the limit");
        let mut b = budget.reserve(40).expect("fits exactly");
        assert_eq!(budget.used(), 100);
        assert!(!b.grow(1));
        assert_eq!(b.bytes(), 40, "a failed grow holds as before");
        drop(a);
        assert!(b.grow(60));
        assert_eq!(budget.used(), 100);
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}
