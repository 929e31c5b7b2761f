//! Whether a client connection has a request in progress, and since when it has not: what
//! closing idle connections after `server.client_timeout_secs` needs, and choosing the admin
//! connection to close when its listener is full.
//!
//! A request is in progress from the moment its head has been read until its response body has
//! been sent (or dropped), so a long streamed answer never counts as idle while a keep-alive
//! connection, an HTTP/2 connection without streams, or one that never sent a request does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::upstream::ProxyBody;

/// The requests in progress on one connection. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Activity(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    active: AtomicUsize,
    /// When the last request in progress ended (or the connection opened).
    idle_since: Mutex<Instant>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity(Arc::new(Inner {
            active: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
        }))
    }
}

impl Activity {
    /// A request starts; it is in progress until the returned guard is dropped.
    pub fn start(&self) -> Active {
        self.0.active.fetch_add(1, Ordering::AcqRel);
        Active(self.0.clone())
    }

    /// When the connection will have been idle for `timeout`; `None` while a request is in
    /// progress.
    pub fn idle_deadline(&self, timeout: Duration) -> Option<Instant> {
        self.idle_since().map(|since| since + timeout)
    }

    /// Since when no request has been in progress; `None` while one is.
    pub fn idle_since(&self) -> Option<Instant> {
        if self.0.active.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(
            *self
                .0
                .idle_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// A request in progress.
#[derive(Debug)]
pub struct Active(Arc<Inner>);

impl Active {
    /// Keeps the request in progress until `body` has been sent or dropped.
    pub fn holding(self, body: ProxyBody) -> ProxyBody {
        crate::upstream::holding(body, self)
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        // The time is written before the count drops, so a reader that sees 0 sees it.
        *self
            .0
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn a_connection_is_idle_only_without_requests_in_progress() {
        let activity = Activity::default();
        let timeout = Duration::from_secs(30);
        let opened = activity.idle_deadline(timeout).expect("idle when opened");
        let first = activity.start();
        let second = activity.start();
        assert_eq!(activity.idle_deadline(timeout), None);
        drop(first);
        assert_eq!(
            activity.idle_deadline(timeout),
            None,
            "one still in progress"
        );
        let body = second.holding(
            Full::new(Bytes::from_static(b"answer"))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        assert_eq!(
            activity.idle_deadline(timeout),
            None,
            "until the body is sent"
        );
        let sent = body.collect().await.expect("body").to_bytes();
        assert_eq!(&sent[..], b"answer");
        let after = activity.idle_deadline(timeout).expect("idle again");
        assert!(after >= opened, "idle since the last request ended");
    }
}
