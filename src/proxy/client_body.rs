//! What is read from the client: a chat body read whole within `server.max_body_bytes` and
//! `server.client_timeout_secs`, and any other body streamed through with the same timeout
//! between two of its chunks.
//!
//! A client that stops sending mid-body must not hold a connection (and, on shutdown, the whole
//! grace period) forever: it gets 408, or, for a body already streaming upstream, an error that
//! ends the exchange.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use crate::error::Error;
use crate::upstream::{BoxError, ProxyBody};

/// Reads a request body whole, refusing more than `limit` bytes (early, from `Content-Length`,
/// when the client declares it) and a body not received within `timeout`.
pub async fn read(
    body: Incoming,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(Error::BodyTooLarge { limit });
    }
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Err(_) => Err(Error::ClientTimeout(timeout)),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Error::BodyTooLarge { limit })
        }
        Ok(Err(e)) => Err(Error::BadRequestBody(e.to_string())),
    }
}

/// A body streamed through as it arrives, failing when the client sends nothing for `timeout`
/// while more is expected.
pub fn streamed(body: Incoming, timeout: Duration) -> ProxyBody {
    Streamed {
        inner: body,
        timeout,
        stall: None,
    }
    .boxed_unsync()
}

struct Streamed {
    inner: Incoming,
    timeout: Duration,
    /// Armed only while the client keeps the body waiting: most bodies arrive whole in the
    /// first poll and never need a timer.
    stall: Option<Pin<Box<Sleep>>>,
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                self.stall = None;
                Poll::Ready(frame.map(|f| f.map_err(BoxError::from)))
            }
            Poll::Pending => {
                let timeout = self.timeout;
                let stall = self
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match stall.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.stall = None;
                        Poll::Ready(Some(Err(Error::ClientTimeout(timeout).into())))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
