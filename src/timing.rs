//! Timing: how much time compactor itself adds to a request.
//!
//! An [`Overhead`] stopwatch starts when a request arrives and stops when its response head
//! is ready. Time spent waiting on something compactor does not control (the upstream's
//! response head, the summarizer) is excluded, either by awaiting through
//! [`Overhead::wait`] or by handing a measured [`Duration`] to [`Overhead::exclude`]. What is
//! left, [`Overhead::finish`], is compactor's own cost (routing, reading and parsing the body,
//! estimating, session lookups, rewriting) and feeds `compactor_overhead_seconds`.

use std::future::IntoFuture;
use std::time::{Duration, Instant};

/// A stopwatch of compactor's own time on one request.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    started: Instant,
    excluded: Duration,
}

impl Overhead {
    /// Starts now.
    pub fn start() -> Overhead {
        Overhead::started_at(Instant::now())
    }

    /// Starts at `started` (e.g. the instant the request was accepted).
    pub fn started_at(started: Instant) -> Overhead {
        Overhead {
            started,
            excluded: Duration::ZERO,
        }
    }

    /// Excludes `waited` (time spent waiting on the upstream or a summarizer, measured
    /// elsewhere) from the overhead.
    pub fn exclude(&mut self, waited: Duration) {
        self.excluded = self.excluded.saturating_add(waited);
    }

    /// Awaits `fut` and excludes the time it took.
    pub async fn wait<F: IntoFuture>(&mut self, fut: F) -> F::Output {
        let began = Instant::now();
        let out = fut.await;
        self.exclude(began.elapsed());
        out
    }

    /// Time excluded so far.
    pub fn excluded(&self) -> Duration {
        self.excluded
    }

    /// Elapsed time since the start minus the excluded time (never negative). Does not stop
    /// the stopwatch: calling it again later gives a larger value.
    pub fn finish(&self) -> Duration {
        self.started.elapsed().saturating_sub(self.excluded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excluded_time_is_subtracted() {
        let started = Instant::now() - Duration::from_secs(10);
        let mut o = Overhead::started_at(started);
        o.exclude(Duration::from_secs(4));
        o.exclude(Duration::from_secs(5));
        assert_eq!(o.excluded(), Duration::from_secs(9));
        let own = o.finish();
        assert!(own >= Duration::from_secs(1), "{own:?}");
        assert!(own < Duration::from_secs(9), "{own:?}");
    }

    #[test]
    fn never_negative() {
        let mut o = Overhead::start();
        o.exclude(Duration::from_secs(3600));
        assert_eq!(o.finish(), Duration::ZERO);
        o.exclude(Duration::MAX);
        assert_eq!(o.excluded(), Duration::MAX);
    }

    #[tokio::test]
    async fn wait_excludes_the_awaited_time() {
        let mut o = Overhead::start();
        // The sleep is what is being measured here, not a synchronisation device.
        let v = o
            .wait(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                7
            })
            .await;
        assert_eq!(v, 7);
        assert!(
            o.excluded() >= Duration::from_millis(50),
            "{:?}",
            o.excluded()
        );
        let total = o.started.elapsed();
        assert!(o.finish() <= total - Duration::from_millis(50));
    }
}
