//! Single flight: one compaction of a conversation prefix at a time.
//!
//! Agents often send several requests of one conversation concurrently (retries, parallel
//! sub-calls). Without coordination each would call the summarizer for the same prefix.
//! [`SingleFlight::run`] makes the first caller for a key the leader, which runs the work in
//! its own task; later callers wait for its result, bounded by a timeout of their choosing,
//! and on timeout (or if the leader is cancelled or panics) get an error so they can forward
//! their request unchanged. The leader publishes through a `tokio::sync::watch` channel owned
//! by the in-flight table; a guard removes the entry when the leader goes away, which closes
//! the channel and releases every waiter.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

/// Why a waiter got no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FlightError {
    /// The leader did not finish within the waiter's timeout (it keeps running).
    #[error("timed out waiting for the in-flight run")]
    Timeout,
    /// The leader was cancelled or panicked before producing a value.
    #[error("the in-flight run was abandoned")]
    Abandoned,
}

/// A value obtained from [`SingleFlight::run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flight<V> {
    /// The value the leader produced.
    pub value: V,
    /// True for the caller that ran the work, false for those that waited for it.
    pub led: bool,
}

enum Role<V> {
    Lead(u64),
    Wait(watch::Receiver<Option<V>>),
}

struct Slot<V> {
    id: u64,
    tx: watch::Sender<Option<V>>,
}

/// Deduplicates concurrent runs per key. Cheap to share behind an `Arc`; the table only holds
/// keys that are running right now.
pub struct SingleFlight<K, V> {
    flights: Mutex<HashMap<K, Slot<V>>>,
    next_id: AtomicU64,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        SingleFlight {
            flights: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        }
    }
}

impl<K, V> fmt::Debug for SingleFlight<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let in_flight = lock(&self.flights).len();
        f.debug_struct("SingleFlight")
            .field("in_flight", &in_flight)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The table stays consistent even if a holder panicked: every critical section is a
    // single map operation.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<K, V> SingleFlight<K, V>
where
    K: Eq + Hash + Clone,
    V: Clone,
{
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `work()` for `key` unless a run for `key` is already in flight, in which case waits
    /// up to `wait_timeout` for that run's value instead.
    ///
    /// The leader's own run is not bounded by `wait_timeout` (bound `work` itself); it runs in
    /// the caller's task, so cancelling the caller abandons the run and releases the waiters
    /// with [`FlightError::Abandoned`]. A key is free again as soon as its leader finishes or
    /// goes away: a value is shared only with callers that arrived while it was being made.
    pub async fn run<F, Fut>(
        &self,
        key: K,
        wait_timeout: Duration,
        work: F,
    ) -> Result<Flight<V>, FlightError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V>,
    {
        let role = {
            let mut flights = lock(&self.flights);
            match flights.get(&key) {
                Some(slot) => Role::Wait(slot.tx.subscribe()),
                None => {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    let (tx, _) = watch::channel(None);
                    flights.insert(key.clone(), Slot { id, tx });
                    Role::Lead(id)
                }
            }
        };
        match role {
            Role::Wait(rx) => wait(rx, wait_timeout).await,
            Role::Lead(id) => {
                let guard = LeaderGuard {
                    flights: &self.flights,
                    key,
                    id,
                };
                let value = work().await;
                guard.publish(value.clone());
                Ok(Flight { value, led: true })
            }
        }
    }

    /// How many keys are running now.
    pub fn in_flight(&self) -> usize {
        lock(&self.flights).len()
    }

    /// Whether a run for `key` is in flight now.
    pub fn is_running(&self, key: &K) -> bool {
        lock(&self.flights).contains_key(key)
    }

    /// How many callers are waiting for `key`'s run (0 when none is in flight).
    pub fn waiters(&self, key: &K) -> usize {
        lock(&self.flights)
            .get(key)
            .map_or(0, |slot| slot.tx.receiver_count())
    }
}

async fn wait<V: Clone>(
    mut rx: watch::Receiver<Option<V>>,
    wait_timeout: Duration,
) -> Result<Flight<V>, FlightError> {
    let outcome = tokio::time::timeout(wait_timeout, async {
        // `wait_for` checks the current value first, so a value published before this point
        // is seen even though the leader has already dropped the sender.
        match rx.wait_for(Option::is_some).await {
            Ok(value) => value.clone(),
            Err(_) => None,
        }
    })
    .await;
    match outcome {
        Ok(Some(value)) => Ok(Flight { value, led: false }),
        Ok(None) => Err(FlightError::Abandoned),
        Err(_) => Err(FlightError::Timeout),
    }
}

/// Owned by the leader while it runs; removing the slot drops the sender, which releases the
/// waiters, whether the leader finished, was cancelled or panicked.
struct LeaderGuard<'a, K: Eq + Hash, V> {
    flights: &'a Mutex<HashMap<K, Slot<V>>>,
    key: K,
    id: u64,
}

impl<K: Eq + Hash, V> LeaderGuard<'_, K, V> {
    fn take_slot(&self) -> Option<Slot<V>> {
        let mut flights = lock(self.flights);
        match flights.get(&self.key) {
            Some(slot) if slot.id == self.id => flights.remove(&self.key),
            _ => None,
        }
    }

    fn publish(self, value: V) {
        if let Some(slot) = self.take_slot() {
            slot.tx.send_replace(Some(value));
        }
        // Drop runs next and finds the slot already gone.
    }
}

impl<K: Eq + Hash, V> Drop for LeaderGuard<'_, K, V> {
    fn drop(&mut self) {
        // Dropped outside the lock: closing the channel wakes the waiters.
        drop(self.take_slot());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use tokio::sync::Notify;

    use super::*;

    /// Long enough never to decide a test that works; short enough that a broken release
    /// fails (as `Timeout`) instead of hanging.
    const LONG: Duration = Duration::from_secs(30);

    /// Yields until `cond` holds: synchronises on observable state, never on elapsed time.
    async fn until(cond: impl Fn() -> bool) {
        let polled = tokio::time::timeout(LONG, async {
            while !cond() {
                tokio::task::yield_now().await;
            }
        });
        assert!(polled.await.is_ok(), "condition never held");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn twenty_callers_one_run() {
        let flight: Arc<SingleFlight<&'static str, String>> = Arc::new(SingleFlight::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (flight, runs, release) = (flight.clone(), runs.clone(), release.clone());
            tasks.spawn(async move {
                flight
                    .run("prefix", LONG, || async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        release.notified().await;
                        "summary".to_string()
                    })
                    .await
            });
        }
        // All 19 others are subscribed before the leader may finish.
        until(|| flight.waiters(&"prefix") == 19).await;
        release.notify_one();
        let mut led = 0;
        while let Some(joined) = tasks.join_next().await {
            let got = joined.unwrap().unwrap();
            assert_eq!(got.value, "summary");
            led += usize::from(got.led);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(led, 1);
        assert_eq!(flight.in_flight(), 0);
    }

    #[tokio::test]
    async fn different_keys_run_independently_and_keys_free_up() {
        let flight: SingleFlight<u32, u32> = SingleFlight::new();
        let a = flight.run(1, LONG, || async { 10 }).await.unwrap();
        let b = flight.run(2, LONG, || async { 20 }).await.unwrap();
        let again = flight.run(1, LONG, || async { 11 }).await.unwrap();
        assert_eq!((a.value, b.value, again.value), (10, 20, 11));
        assert!(a.led && b.led && again.led);
        assert_eq!(flight.in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_leader_releases_its_waiters() {
        let flight: Arc<SingleFlight<u8, u8>> = Arc::new(SingleFlight::new());
        let started = Arc::new(Notify::new());
        let leader = {
            let (flight, started) = (flight.clone(), started.clone());
            tokio::spawn(async move {
                flight
                    .run(7, LONG, || async move {
                        started.notify_one();
                        std::future::pending::<u8>().await
                    })
                    .await
            })
        };
        started.notified().await;
        let waiter = {
            let flight = flight.clone();
            tokio::spawn(async move { flight.run(7, LONG, || async { 99 }).await })
        };
        until(|| flight.waiters(&7) == 1).await;
        leader.abort();
        assert!(leader.await.unwrap_err().is_cancelled());
        assert_eq!(waiter.await.unwrap(), Err(FlightError::Abandoned));
        assert_eq!(flight.in_flight(), 0);
        // The key is free: the next caller leads.
        assert_eq!(flight.run(7, LONG, || async { 5 }).await.unwrap().value, 5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_leader_releases_its_waiters() {
        let flight: Arc<SingleFlight<u8, u8>> = Arc::new(SingleFlight::new());
        let go = Arc::new(Notify::new());
        let leader = {
            let (flight, go) = (flight.clone(), go.clone());
            tokio::spawn(async move {
                flight
                    .run(1, LONG, || async move {
                        go.notified().await;
                        panic!("summarizer bug");
                    })
                    .await
            })
        };
        until(|| flight.in_flight() == 1).await;
        let waiter = {
            let flight = flight.clone();
            tokio::spawn(async move { flight.run(1, LONG, || async { 0 }).await })
        };
        until(|| flight.waiters(&1) == 1).await;
        go.notify_one();
        assert!(leader.await.unwrap_err().is_panic());
        assert_eq!(waiter.await.unwrap(), Err(FlightError::Abandoned));
        assert_eq!(flight.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_waiter_times_out_while_the_leader_keeps_running() {
        // tokio's `test-util` (time::pause) is not enabled in this crate: the leader never
        // finishes, so the outcome is decided by the timeout alone, whatever the machine load.
        let flight: Arc<SingleFlight<u8, u8>> = Arc::new(SingleFlight::new());
        let started = Arc::new(Notify::new());
        let leader = {
            let (flight, started) = (flight.clone(), started.clone());
            tokio::spawn(async move {
                flight
                    .run(3, LONG, || async move {
                        started.notify_one();
                        std::future::pending::<u8>().await
                    })
                    .await
            })
        };
        started.notified().await;
        let got = flight
            .run(3, Duration::from_millis(20), || async { 1 })
            .await;
        assert_eq!(got, Err(FlightError::Timeout));
        assert_eq!(flight.in_flight(), 1, "the leader is still running");
        leader.abort();
    }

    #[test]
    fn run_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let flight: SingleFlight<String, Arc<String>> = SingleFlight::new();
        let fut = flight.run("k".to_string(), LONG, || async { Arc::new(String::new()) });
        assert_send(&fut);
    }
}
