//! `server.max_buffered_bytes`: the chat bodies held in memory at once, across requests.
//!
//! A chat body is read whole to be compacted, and kept until the provider's answer has begun
//! (a refusal for length is retried from it). Under a burst of large bodies that memory adds
//! up, so every body reserves its room before it is read: as much as it declares
//! (`Content-Length`), or, sent in chunks, as much as a body may be (`server.max_body_bytes`,
//! at most the whole budget), the part it did not need returned once it is read.
//!
//! Each request reserves once, all it may need, and waits its turn for it (first come, first
//! served): no request holds part of the budget while waiting for more, so bodies that fit
//! are read one after another instead of each taking a slice and none getting enough, and a
//! body that fits is never left uncompacted because others hold room they will return. The
//! wait is bounded by the caller; past it the body is streamed upstream uncompacted (fail
//! open). Reservations count in KiB on a fair semaphore.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

/// The budget's unit: reservations are rounded up to it.
const UNIT: usize = 1024;

/// Bytes of chat bodies that may be held at once.
#[derive(Debug)]
pub struct BufferBudget {
    limit: usize,
    /// Free units; waiters are served in order.
    free: Semaphore,
    /// Units in all.
    units: usize,
}

impl BufferBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<BufferBudget> {
        let units = limit.div_ceil(UNIT).min(Semaphore::MAX_PERMITS);
        Arc::new(BufferBudget {
            limit,
            free: Semaphore::new(units),
            units,
        })
    }

    /// Bytes that may be held at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now (in whole units).
    pub fn used(&self) -> usize {
        (self.units - self.free.available_permits()) * UNIT
    }

    /// Holds `bytes` of the budget, waiting up to `within` for others to return them; `None`
    /// when they never fit (more than the whole budget) or did not come free in time.
    pub async fn reserve(self: &Arc<Self>, bytes: usize, within: Duration) -> Option<Held> {
        let units = u32::try_from(bytes.div_ceil(UNIT)).ok()?;
        if units as usize > self.units {
            return None;
        }
        let permit = tokio::time::timeout(within, self.free.acquire_many(units))
            .await
            .ok()?
            .ok()?;
        // Returned by `Held`'s drop, which may give back part of it earlier.
        permit.forget();
        Some(Held {
            budget: self.clone(),
            units: units as usize,
        })
    }
}

/// A part of the budget, returned when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Arc<BufferBudget>,
    units: usize,
}

impl Held {
    /// Bytes held (in whole units).
    pub fn bytes(&self) -> usize {
        self.units * UNIT
    }

    /// Returns what is held beyond `bytes` (a body that turned out smaller than reserved).
    pub fn shrink_to(&mut self, bytes: usize) {
        let keep = bytes.div_ceil(UNIT).min(self.units);
        self.budget.free.add_permits(self.units - keep);
        self.units = keep;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.free.add_permits(self.units);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn reservations_fit_the_limit_and_are_returned_when_dropped() {
        let budget = BufferBudget::new(100 * UNIT);
        let a = budget.reserve(60 * UNIT, WAIT).await.expect("fits");
        let mut b = budget.reserve(40 * UNIT, WAIT).await.expect("fits exactly");
        assert_eq!(budget.used(), 100 * UNIT);
        b.shrink_to(10 * UNIT + 1);
        assert_eq!((b.bytes(), budget.used()), (11 * UNIT, 71 * UNIT));
        drop(a);
        drop(b);
        assert_eq!(budget.used(), 0);
        assert!(
            budget.reserve(101 * UNIT, WAIT).await.is_none(),
            "never fits"
        );
    }

    #[tokio::test]
    async fn a_request_that_fits_waits_for_room_others_return() {
        let budget = BufferBudget::new(32 * UNIT);
        let first = budget.reserve(20 * UNIT, WAIT).await.expect("fits");
        // Does not fit beside `first`: it waits instead of being turned away.
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(20 * UNIT, WAIT).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        // A later, smaller request queues behind it (no one starves the larger one).
        let behind = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(4 * UNIT, WAIT).await.map(|h| h.bytes()) }
        });
        tokio::task::yield_now().await;
        assert!(!behind.is_finished());
        drop(first);
        let second = waiting.await.expect("task").expect("fits once returned");
        assert_eq!(second.bytes(), 20 * UNIT);
        assert_eq!(behind.await.expect("task"), Some(4 * UNIT));
        // A wait the caller bounds ends without the room: the caller streams the body.
        let short = Duration::from_millis(20);
        assert!(budget.reserve(30 * UNIT, short).await.is_none());
        drop(second);
        assert!(budget.reserve(30 * UNIT, short).await.is_some());
        assert_eq!(budget.used(), 0);
    }
}
