//! The summaries made off the request path (`compaction.background_ratio`): a bounded set of
//! tasks that shutdown can abandon.
//!
//! At most `summarizer.max_concurrent` run at once; a summary that finds no free slot is not
//! started (the request that crosses the trigger makes it, as without background summaries),
//! so a burst of long conversations never queues work that would be stale by the time it ran.
//! Shutdown aborts whatever still runs: a summary abandoned mid-way stores nothing, and any
//! request waiting for it is released by the single flight and forwarded as it can be.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The background summaries of a pipeline (shared with the pipelines that replace it on
/// reload, so shutdown reaches every one).
#[derive(Debug)]
pub struct Background {
    permits: Arc<Semaphore>,
    tasks: Mutex<JoinSet<()>>,
    closed: AtomicBool,
    /// Hashes of the prefixes already tried, so a conversation waiting between the watermark
    /// and the trigger starts one summary, not one per request (bounded: forgotten all at once
    /// when full, at worst one more try each).
    attempted: Mutex<HashSet<u64>>,
    /// Hashes of the prefixes whose summary runs now ([`Background::is_running`]).
    running: Arc<Mutex<HashSet<u64>>>,
}

/// Marks a prefix's summary as running for as long as its task lives (aborted included).
struct Making {
    running: Arc<Mutex<HashSet<u64>>>,
    key: u64,
}

impl Drop for Making {
    fn drop(&mut self) {
        lock(&self.running).remove(&self.key);
    }
}

fn lock(set: &Mutex<HashSet<u64>>) -> MutexGuard<'_, HashSet<u64>> {
    // A set of hashes, valid after any panic.
    set.lock().unwrap_or_else(PoisonError::into_inner)
}

fn hash_of(key: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    key.hash(&mut hasher);
    hasher.finish()
}

/// Prefixes remembered as tried at most.
const MAX_ATTEMPTED: usize = 16_384;

impl Background {
    /// Room for `max_concurrent` summaries at once (at least one).
    pub fn new(max_concurrent: usize) -> Background {
        Background {
            permits: Arc::new(Semaphore::new(max_concurrent.max(1))),
            tasks: Mutex::new(JoinSet::new()),
            closed: AtomicBool::new(false),
            attempted: Mutex::default(),
            running: Arc::default(),
        }
    }

    /// True the first time it is asked about `key` (then remembered as tried).
    pub fn first_attempt(&self, key: &impl Hash) -> bool {
        let mut attempted = lock(&self.attempted);
        if attempted.len() >= MAX_ATTEMPTED {
            attempted.clear();
        }
        attempted.insert(hash_of(key))
    }

    /// Whether the summary of `key` started by [`Background::spawn`] is still being made.
    pub fn is_running(&self, key: &impl Hash) -> bool {
        lock(&self.running).contains(&hash_of(key))
    }

    fn tasks(&self) -> MutexGuard<'_, JoinSet<()>> {
        // The set is only spawned into, reaped and aborted: valid after any panic.
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `work`, the summary of `key`, unless `max_concurrent` summaries are running,
    /// shutdown has begun, or there is no runtime to run it on. False when it was not
    /// started.
    pub fn spawn(&self, key: &impl Hash, work: impl Future<Output = ()> + Send + 'static) -> bool {
        if self.closed.load(Ordering::Acquire) || tokio::runtime::Handle::try_current().is_err() {
            return false;
        }
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            return false;
        };
        let mut tasks = self.tasks();
        // Finished tasks leave their results in the set until reaped.
        while tasks.try_join_next().is_some() {}
        let key = hash_of(key);
        lock(&self.running).insert(key);
        let making = Making {
            running: self.running.clone(),
            key,
        };
        tasks.spawn(async move {
            let _permit = permit;
            let _making = making;
            work.await;
        });
        true
    }

    /// Summaries running now.
    #[cfg(test)]
    fn running(&self) -> usize {
        let mut tasks = self.tasks();
        while tasks.try_join_next().is_some() {}
        tasks.len()
    }

    /// Shutdown: aborts every running summary (none stores anything) and starts no more.
    /// Returns how many were abandoned.
    pub fn abandon(&self) -> usize {
        self.closed.store(true, Ordering::Release);
        let mut tasks = self.tasks();
        while tasks.try_join_next().is_some() {}
        let running = tasks.len();
        tasks.abort_all();
        running
    }

    /// Waits until no summary runs (the replay tool: an agent's think time outlasting a
    /// summary, so replays are deterministic).
    pub async fn idle(&self) {
        loop {
            let mut running = std::mem::take(&mut *self.tasks());
            if running.is_empty() {
                return;
            }
            while running.join_next().await.is_some() {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn at_most_max_concurrent_run_and_a_finished_one_frees_its_slot() {
        let background = Background::new(2);
        let (release_a, a) = oneshot::channel::<()>();
        let (release_b, b) = oneshot::channel::<()>();
        assert!(background.spawn(&1, async move {
            let _ = a.await;
        }));
        assert!(background.spawn(&2, async move {
            let _ = b.await;
        }));
        assert!(!background.spawn(&3, async {}), "both slots taken");
        assert_eq!(background.running(), 2);
        release_a.send(()).expect("task waiting");
        release_b.send(()).expect("task waiting");
        background.idle().await;
        assert_eq!(background.running(), 0);
        assert!(background.spawn(&4, async {}), "slots freed");
        background.idle().await;
    }

    #[tokio::test]
    async fn abandon_aborts_running_summaries_and_refuses_new_ones() {
        let background = Background::new(4);
        let (dropped_tx, dropped) = oneshot::channel::<()>();
        // The task holds the sender until it is aborted: dropping it resolves `dropped`.
        assert!(background.spawn(&5, async move {
            let _held = dropped_tx;
            std::future::pending::<()>().await;
        }));
        assert_eq!(background.abandon(), 1);
        assert!(
            dropped.await.is_err(),
            "the task was dropped, not completed"
        );
        assert!(!background.spawn(&6, async {}), "closed");
        background.idle().await;
    }

    #[test]
    fn a_prefix_is_attempted_once() {
        let background = Background::new(1);
        assert!(background.first_attempt(&("tenant", "session", 0)));
        assert!(!background.first_attempt(&("tenant", "session", 0)));
        assert!(background.first_attempt(&("tenant", "session", 7)));
    }

    #[test]
    fn without_a_runtime_nothing_is_started() {
        let background = Background::new(1);
        assert!(!background.spawn(&7, async {}));
    }
}
