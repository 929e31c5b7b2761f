//! Buffers of large chat bodies, kept for the next body of their size once the last reference
//! to a body is gone.
//!
//! A chat body is read into one buffer, and that buffer outlives its request: the session
//! store keeps the conversation's latest request and the scan memo its array, both as slices
//! of the body. Each large body therefore came in a fresh allocation, which the allocator
//! maps from the kernel and the copy then faults in page by page: for a 4 MB request about
//! 1,000 page faults, a tenth of what compactor spends on it. An agent's next request is the
//! same size or a little larger, so the buffer its previous-but-one request freed is the one
//! it needs: [`BodyPool`] keeps freed buffers of at least [`MIN_POOLED`] bytes (below that the
//! allocator reuses its own heap without faulting) and hands them out by size class.
//!
//! A buffer's capacity is its body's length rounded up to a class, at most an eighth more
//! (16 classes per doubling), so a growing conversation finds its class's buffers for many
//! turns and a small body never holds a large buffer. Idle buffers hold at most a quarter of
//! `server.max_buffered_bytes`; beyond it the least recently freed go back to the allocator.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use bytes::Bytes;

/// Bodies shorter than this are allocated as they come and never pooled.
pub const MIN_POOLED: usize = 1 << 20;

/// Freed body buffers, by recency.
#[derive(Debug)]
pub struct BodyPool {
    idle: Mutex<Idle>,
    /// Bytes the idle buffers may hold at most.
    limit: usize,
}

#[derive(Debug, Default)]
struct Idle {
    buffers: VecDeque<Vec<u8>>,
    /// Their capacities, summed.
    bytes: usize,
}

impl BodyPool {
    /// A pool whose idle buffers hold at most `limit` bytes.
    pub fn new(limit: usize) -> Arc<BodyPool> {
        Arc::new(BodyPool {
            idle: Mutex::new(Idle::default()),
            limit,
        })
    }

    /// An empty buffer that holds `len` bytes without growing: an idle one of `len`'s class
    /// (the most recently freed), else a new one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let capacity = class(len);
        if capacity >= MIN_POOLED {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let found = idle.buffers.iter().rposition(|b| b.capacity() == capacity);
            if let Some(mut buffer) = found.and_then(|at| idle.buffers.remove(at)) {
                idle.bytes -= buffer.capacity();
                buffer.clear();
                return buffer;
            }
        }
        Vec::with_capacity(capacity)
    }

    /// `buffer` as a body, which gives the buffer back when its last reference is dropped.
    pub fn freeze(self: &Arc<Self>, buffer: Vec<u8>) -> Bytes {
        if buffer.capacity() < MIN_POOLED {
            return Bytes::from(buffer);
        }
        Bytes::from_owner(Pooled {
            buffer,
            pool: Arc::downgrade(self),
        })
    }

    /// Keeps a freed buffer, letting the least recently freed go past the limit.
    fn give(&self, buffer: Vec<u8>) {
        if buffer.capacity() > self.limit || buffer.capacity() != class(buffer.capacity()) {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.bytes += buffer.capacity();
        idle.buffers.push_back(buffer);
        while idle.bytes > self.limit {
            match idle.buffers.pop_front() {
                Some(old) => idle.bytes -= old.capacity(),
                None => break,
            }
        }
    }

    /// Bytes the idle buffers hold.
    pub fn idle_bytes(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }
}

/// The capacity a body of `len` bytes gets: `len` below [`MIN_POOLED`], else `len` rounded up
/// to a sixteenth of the power of two above it (at most an eighth of `len` more).
fn class(len: usize) -> usize {
    if len < MIN_POOLED {
        return len;
    }
    let step = len.checked_next_power_of_two().map_or(1, |p| p / 16);
    len.div_ceil(step).saturating_mul(step)
}

/// A pooled body's bytes, given back to the pool when dropped.
struct Pooled {
    buffer: Vec<u8>,
    /// Weak: a body outliving the pool (kept by the store) is simply freed.
    pool: Weak<BodyPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.buffer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_by_at_most_an_eighth_and_are_their_own_class() {
        for len in [
            MIN_POOLED,
            MIN_POOLED + 1,
            3 << 20,
            4_000_000,
            (4 << 20) - 1,
            4 << 20,
            (4 << 20) + 1,
            31_500_000,
        ] {
            let c = class(len);
            assert!(c >= len && c - len <= len / 8, "{len} → {c}");
            assert_eq!(class(c), c, "{len} → {c}");
        }
        assert_eq!(class(MIN_POOLED - 1), MIN_POOLED - 1);
        assert_eq!(
            class(4_000_000),
            class(4_050_000),
            "a turn's growth stays in its class"
        );
        assert_eq!(class(4_000_000), 4_194_304);
    }

    #[test]
    fn a_dropped_body_gives_its_buffer_to_the_next_body_of_its_class() {
        let pool = BodyPool::new(64 << 20);
        let mut buffer = pool.take(4_000_000);
        let capacity = buffer.capacity();
        buffer.extend_from_slice(&[b'x'; 4_000_000]);
        let at = buffer.as_ptr();
        let body = pool.freeze(buffer);
        let slice = body.slice(10..20);
        drop(body);
        assert_eq!(pool.idle_bytes(), 0, "a slice still holds it");
        drop(slice);
        assert_eq!(pool.idle_bytes(), capacity);
        // A larger body of the same class gets it, empty; one of another class does not.
        let other = pool.take(8_000_000);
        assert_ne!(other.as_ptr(), at);
        let again = pool.take(4_050_000);
        assert_eq!((again.as_ptr(), again.len()), (at, 0));
        assert_eq!(pool.idle_bytes(), 0);
    }

    #[test]
    fn small_bodies_are_not_pooled_and_idle_buffers_stay_within_the_limit() {
        let pool = BodyPool::new(10 << 20);
        drop(pool.freeze(pool.take(1000)));
        assert_eq!(pool.idle_bytes(), 0);
        let bodies: Vec<Bytes> = (0..4)
            .map(|_| {
                let mut b = pool.take(3 << 20);
                b.resize(3 << 20, 0);
                pool.freeze(b)
            })
            .collect();
        drop(bodies);
        assert_eq!(pool.idle_bytes(), 9 << 20, "three of four kept");
        // Larger than the limit: freed, never kept.
        drop(pool.freeze(pool.take(12 << 20)));
        assert_eq!(pool.idle_bytes(), 9 << 20);
        // A body outliving its pool is freed.
        let body = pool.freeze(pool.take(2 << 20));
        drop(pool);
        drop(body);
    }
}
