//! A bound on clients that stop reading: a write to the client's socket that makes no progress
//! for the client timeout fails, which ends the connection and releases its slot, its upstream
//! stream and the drain on shutdown. hyper has no write timeout, so the socket is wrapped.
//!
//! The deadline bounds a lack of progress, not a response's duration: it is armed when a write
//! (or a flush, or TLS's close) cannot proceed and cleared by the next one that does, so a
//! client that reads slowly but steadily keeps its stream however long it lasts. The kernel's
//! send buffer sits in between: a blocked write proceeds again only once a good part of that
//! buffer (up to a few MB) has drained, so a client must read about that much per timeout.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `io` with a write timeout; reads pass through.
pub struct SendTimeout<T> {
    io: T,
    timeout: Duration,
    /// Armed while a write is blocked; boxed so the wrapper stays `Unpin`.
    deadline: Pin<Box<Sleep>>,
    armed: bool,
    /// Called once, when the timeout ends the connection (counting and logging it).
    on_timeout: Option<Box<dyn FnOnce() + Send>>,
}

impl<T> SendTimeout<T> {
    /// Wraps `io`; `on_timeout` runs once if a write stays blocked for `timeout`.
    pub fn new(io: T, timeout: Duration, on_timeout: impl FnOnce() + Send + 'static) -> Self {
        SendTimeout {
            io,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            armed: false,
            on_timeout: Some(Box::new(on_timeout)),
        }
    }

    /// Passes a write's outcome on, arming the deadline when it is blocked and clearing it when
    /// it is not; past the deadline, a timeout error.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if self.on_timeout.is_none() {
            return Poll::Ready(Err(timed_out()));
        }
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        if !self.armed {
            self.armed = true;
            let deadline = Instant::now() + self.timeout;
            self.deadline.as_mut().reset(deadline);
        }
        // Polling the timer registers this task's waker with it, so the connection is polled
        // again at the deadline even if the client never reads another byte.
        match self.deadline.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                if let Some(on_timeout) = self.on_timeout.take() {
                    on_timeout();
                }
                Poll::Ready(Err(timed_out()))
            }
        }
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the client read nothing within the client timeout",
    )
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A pipe whose reader takes nothing: the writer fills it, then is blocked for good.
    #[tokio::test]
    async fn a_write_blocked_for_the_timeout_fails_once_counted() {
        let (_client, server) = tokio::io::duplex(16);
        let fired = Arc::new(AtomicUsize::new(0));
        let counter = fired.clone();
        let timeout = Duration::from_millis(100);
        let mut io = SendTimeout::new(server, timeout, move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let started = Instant::now();
        let err = io.write_all(&[0u8; 64]).await.expect_err("blocked write");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= timeout, "not before the timeout");
        assert_eq!(fired.load(Ordering::SeqCst), 1);
        let again = io.write_all(b"x").await.expect_err("stays failed");
        assert_eq!(again.kind(), io::ErrorKind::TimedOut);
        assert_eq!(fired.load(Ordering::SeqCst), 1, "counted once");
    }

    /// A reader that takes a little every 20 ms keeps a 500 ms timeout from firing over a
    /// write that lasts several timeouts.
    #[tokio::test]
    async fn a_slow_steady_reader_is_not_cut() {
        let (mut client, server) = tokio::io::duplex(16);
        let timeout = Duration::from_millis(500);
        let mut io = SendTimeout::new(server, timeout, || {});
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            loop {
                // The reader's pace, not synchronisation.
                tokio::time::sleep(Duration::from_millis(20)).await;
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        let started = Instant::now();
        let len = 16 * 100;
        io.write_all(&vec![7u8; len])
            .await
            .expect("never blocked a whole timeout");
        io.shutdown().await.expect("shutdown");
        drop(io);
        let got = reader.await.expect("reader");
        assert_eq!(got.len(), len);
        assert!(
            started.elapsed() > timeout * 3,
            "longer than the timeout in all"
        );
    }
}
