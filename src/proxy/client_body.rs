//! What is read from the client: a chat body read whole within `server.max_body_bytes`,
//! `server.client_timeout_secs` and the buffer budget (`server.max_buffered_bytes`), and any
//! other body (or a chat body the budget cannot hold) streamed through with the same timeout
//! between two of its chunks.
//!
//! A client that stops sending mid-body must not hold a connection (and, on shutdown, the whole
//! grace period) forever: it gets 408, or, for a body already streaming upstream, an error that
//! ends the exchange.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use super::body_pool::BodyPool;
use crate::budget::{BufferBudget, Held};
use crate::error::Error;
use crate::upstream::{BoxError, ProxyBody};

/// A chat body as read: whole, within the buffer budget, or (the budget being spent) what had
/// arrived so far and the rest still to come, to be streamed through uncompacted.
pub enum Read {
    /// The whole body, and its share of the budget (hold it as long as the body).
    Whole(Bytes, Held),
    /// The budget could not hold it.
    OverBudget(Streaming),
}

/// A body to stream through: what was read already, the rest, and the budget the part read
/// holds until it is sent.
pub struct Streaming {
    prefix: Option<Bytes>,
    rest: Incoming,
    held: Option<Held>,
    /// `server.max_body_bytes` for a chat body (`usize::MAX`: no limit).
    limit: usize,
}

/// Reads a request body whole, refusing more than `limit` bytes (early, from `Content-Length`,
/// when the client declares it) and a body not received within `timeout`. Before reading it
/// reserves in `budget` what the body may need (see [`super::budget`]), waiting for it up to
/// `timeout`; a body the budget cannot hold (declared beyond it, or no room in time) is
/// streamed through, and beyond `limit` ends in 413 all the same: the answer to a body over
/// the limit never depends on other traffic.
pub async fn read(
    mut body: Incoming,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
    budget: &Arc<BufferBudget>,
    pool: &Arc<BodyPool>,
) -> Result<Read, Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(Error::BodyTooLarge { limit });
    }
    // Sent in chunks, a body may be anything up to `limit`: as much is held (at most the
    // whole budget) until it is read, then the rest is returned.
    let need = declared.unwrap_or(limit);
    let held = match declared {
        Some(n) if n > budget.limit() => None,
        _ => budget.reserve(need.min(budget.limit()), timeout).await,
    };
    let Some(mut held) = held else {
        return Ok(Read::OverBudget(Streaming {
            prefix: None,
            rest: body,
            held: None,
            limit,
        }));
    };
    // One timer for the whole body, registered once (a timer per frame would take the
    // runtime's timer lock for every frame of a large body).
    let expired = tokio::time::sleep(timeout);
    tokio::pin!(expired);
    // A declared body is copied into one buffer as it arrives (each chunk freed at once):
    // never twice its size in memory.
    let mut whole = match declared {
        Some(len) => pool.take(len),
        None => Vec::new(),
    };
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    loop {
        let frame = tokio::select! {
            biased;
            frame = body.frame() => frame,
            () = &mut expired => return Err(Error::ClientTimeout(timeout)),
        };
        let frame = match frame {
            None => break,
            Some(Err(e)) => return Err(Error::BadRequestBody(e.to_string())),
            Some(Ok(frame)) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers: not part of the JSON
        };
        if len + data.len() > limit {
            return Err(Error::BodyTooLarge { limit });
        }
        // Only a chunked body beyond the whole budget (`limit` above it) gets here.
        if len + data.len() > held.bytes() {
            let total = len + data.len();
            chunks.push(data);
            return Ok(Read::OverBudget(Streaming {
                prefix: Some(concat(chunks, total, pool)),
                rest: body,
                held: Some(held),
                limit,
            }));
        }
        len += data.len();
        if declared.is_some() {
            whole.extend_from_slice(&data);
        } else {
            chunks.push(data);
        }
    }
    held.shrink_to(len);
    let body = if declared.is_some() {
        pool.freeze(whole)
    } else {
        concat(chunks, len, pool)
    };
    Ok(Read::Whole(body, held))
}

/// The chunks as one buffer (without a copy when there is one).
fn concat(mut chunks: Vec<Bytes>, len: usize, pool: &Arc<BodyPool>) -> Bytes {
    if chunks.len() == 1 {
        return chunks.pop().unwrap_or_default();
    }
    let mut whole = pool.take(len);
    for chunk in chunks {
        whole.extend_from_slice(&chunk);
    }
    pool.freeze(whole)
}

impl Streaming {
    /// Streams the body through, failing when the client sends nothing for `timeout` while
    /// more is expected.
    pub fn into_body(self, timeout: Duration) -> ProxyBody {
        Streamed {
            sent: self.prefix.as_ref().map_or(0, Bytes::len),
            prefix: self.prefix,
            inner: self.rest,
            timeout,
            stall: None,
            limit: self.limit,
            _held: self.held,
        }
        .boxed_unsync()
    }
}

/// A body streamed through as it arrives, failing when the client sends nothing for `timeout`
/// while more is expected.
pub fn streamed(body: Incoming, timeout: Duration) -> ProxyBody {
    Streaming {
        prefix: None,
        rest: body,
        held: None,
        limit: usize::MAX,
    }
    .into_body(timeout)
}

struct Streamed {
    prefix: Option<Bytes>,
    inner: Incoming,
    timeout: Duration,
    /// Armed only while the client keeps the body waiting: most bodies arrive whole in the
    /// first poll and never need a timer.
    stall: Option<Pin<Box<Sleep>>>,
    /// Bytes passed on so far, and how many may be (`server.max_body_bytes` for a chat body).
    sent: usize,
    limit: usize,
    /// The budget the prefix holds, returned when the body has been sent.
    _held: Option<Held>,
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                self.stall = None;
                let size = match &frame {
                    Some(Ok(f)) => f.data_ref().map_or(0, Bytes::len),
                    _ => 0,
                };
                self.sent = self.sent.saturating_add(size);
                if self.sent > self.limit {
                    // The exchange ends, and the client is answered 413 (`proxy::send`).
                    let limit = self.limit;
                    return Poll::Ready(Some(Err(Error::BodyTooLarge { limit }.into())));
                }
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
        self.prefix.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(prefix));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(prefix));
        }
        hint
    }
}
