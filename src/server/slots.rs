//! Connection slots of one listener: at most so many connections are held at once, and
//! accepting waits for a free slot (the kernel's backlog holds the clients meanwhile).
//!
//! The admin listener also makes room: when its slots are all taken it closes the connection
//! that has been idle longest (no request in progress: a keep-alive scraper, a client that
//! connected and sent nothing or half a head), one at a time, so a liveness probe is served at
//! once however many idle clients reconnect. Only connections with a request in progress are
//! never closed for room; those are bounded by the client timeout in both directions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::activity::Activity;

/// The slots of one listener. Shared with every connection holding one.
pub struct Slots {
    semaphore: Arc<Semaphore>,
    capacity: usize,
    /// Whether a full listener closes its longest-idle connection (the admin listener).
    makes_room: bool,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    next_id: u64,
    /// The connections that may be closed for room, with what tells them to.
    connections: HashMap<u64, (Activity, Arc<Notify>)>,
    /// The connection told to close and not gone yet: one at a time, so a listener that stays
    /// full does not close every idle connection while the first is closing.
    closing: Option<u64>,
}

impl Slots {
    /// `capacity` slots; `makes_room` for the admin listener.
    pub fn new(capacity: usize, makes_room: bool) -> Arc<Slots> {
        Arc::new(Slots {
            semaphore: Arc::new(Semaphore::new(capacity)),
            capacity,
            makes_room,
            held: Mutex::new(Held::default()),
        })
    }

    /// Slots taken now.
    pub fn taken(&self) -> usize {
        self.capacity - self.semaphore.available_permits()
    }

    /// Waits for a free slot (making room first, if this listener does), to be taken by the
    /// next connection accepted. Cancel-safe: a slot reserved by a future that is dropped is
    /// returned.
    pub async fn reserve(self: &Arc<Self>) -> Reserved {
        let permit = match self.semaphore.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                if self.makes_room {
                    self.close_longest_idle();
                }
                // The semaphore is never closed, so this does not fail; were it to, holding no
                // slot is the safe side.
                self.semaphore.clone().acquire_owned().await.ok()
            }
        };
        Reserved {
            permit,
            slots: self.clone(),
        }
    }

    /// Tells the connection idle longest to close, unless one is closing already.
    fn close_longest_idle(&self) {
        let mut held = self.lock();
        if held.closing.is_some() {
            return;
        }
        let longest = held
            .connections
            .iter()
            .filter_map(|(id, (activity, close))| Some((activity.idle_since()?, *id, close)))
            // The earlier accepted first among equals.
            .min_by_key(|(since, id, _)| (*since, *id))
            .map(|(_, id, close)| (id, close.clone()));
        if let Some((id, close)) = longest {
            held.closing = Some(id);
            // Stored if the connection is not waiting right now: it sees it on its next poll.
            close.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A free slot waiting for a connection: returned when dropped.
pub struct Reserved {
    permit: Option<OwnedSemaphorePermit>,
    slots: Arc<Slots>,
}

impl Reserved {
    /// The connection just accepted takes the slot; it is idle from now on.
    pub fn occupy(self) -> Slot {
        let Reserved { permit, slots } = self;
        let activity = Activity::default();
        let close = Arc::new(Notify::new());
        let mut held = slots.lock();
        let id = held.next_id;
        held.next_id += 1;
        if slots.makes_room {
            held.connections
                .insert(id, (activity.clone(), close.clone()));
        }
        drop(held);
        Slot {
            _permit: permit,
            id,
            activity,
            close,
            slots,
        }
    }
}

/// One connection's slot, released when dropped, with the connection's [`Activity`].
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
    id: u64,
    activity: Activity,
    close: Arc<Notify>,
    slots: Arc<Slots>,
}

impl Slot {
    /// The requests in progress on this connection.
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// Completes when the listener needs this connection's slot for a new one.
    pub async fn close_requested(&self) {
        self.close.notified().await;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.lock();
        held.connections.remove(&self.id);
        if held.closing == Some(self.id) {
            held.closing = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::FutureExt;
    use std::future::Future;

    /// Polls `fut` once: its output if it completed.
    async fn ready_now<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = fut => Some(out),
            () = std::future::ready(()) => None,
        }
    }

    /// A slot taken by a connection.
    async fn occupied(slots: &Arc<Slots>) -> Slot {
        slots.reserve().await.occupy()
    }

    #[tokio::test]
    async fn a_full_admin_listener_closes_the_connection_idle_longest() {
        let slots = Slots::new(3, true);
        let oldest = occupied(&slots).await;
        let busy = occupied(&slots).await;
        let newer = occupied(&slots).await;
        // `busy` was idle before `newer` but has a request in progress: never closed for room.
        let _request = busy.activity().start();
        assert_eq!(slots.taken(), 3);

        let mut fourth = Box::pin(occupied(&slots));
        assert!(ready_now(&mut fourth).await.is_none(), "no slot yet");
        assert!(
            oldest.close_requested().now_or_never().is_some(),
            "the longest-idle connection is told to close"
        );
        let mut fifth = Box::pin(occupied(&slots));
        assert!(ready_now(&mut fifth).await.is_none());
        assert!(
            newer.close_requested().now_or_never().is_none(),
            "one at a time"
        );
        assert!(busy.close_requested().now_or_never().is_none());
        drop(oldest);
        let fourth = ready_now(&mut fourth).await.expect("its slot is free");
        drop(fifth);
        assert_eq!(slots.taken(), 3);
        drop((busy, newer, fourth));
        assert_eq!(slots.taken(), 0);
    }

    #[tokio::test]
    async fn a_connection_is_idle_from_when_it_was_accepted_not_when_its_slot_was_reserved() {
        let slots = Slots::new(2, true);
        // The accept loop reserves a slot long before the next client arrives.
        let reserved = slots.reserve().await;
        let earlier = occupied(&slots).await;
        let later = reserved.occupy();
        let mut third = Box::pin(occupied(&slots));
        assert!(ready_now(&mut third).await.is_none(), "no slot yet");
        assert!(earlier.close_requested().now_or_never().is_some());
        assert!(later.close_requested().now_or_never().is_none());
    }

    #[tokio::test]
    async fn a_full_proxy_listener_waits_without_closing_anyone() {
        let slots = Slots::new(1, false);
        let only = occupied(&slots).await;
        let mut second = Box::pin(occupied(&slots));
        assert!(ready_now(&mut second).await.is_none(), "no slot yet");
        assert!(
            only.close_requested().now_or_never().is_none(),
            "an idle proxy connection is not closed for room"
        );
        drop(only);
        assert!(ready_now(&mut second).await.is_some(), "its slot is free");
    }
}
