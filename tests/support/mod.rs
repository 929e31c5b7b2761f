//! Shared test support: a scriptable mock upstream, a real HTTP client, the proxy started
//! in-process on `127.0.0.1:0`, Prometheus scraping and throwaway TLS material.
//!
//! Every integration test (and `benches/load.rs`) includes this module with `mod support;`;
//! each uses a different subset, hence the blanket `dead_code` allowance.
#![allow(dead_code, unused_imports)]

pub mod agent_provider;
pub mod anthropic_rules;
pub mod binary;
pub mod client;
pub mod fixtures;
pub mod metrics;
pub mod mock;
pub mod provider_rules;
pub mod proxy;
pub mod redis_server;
pub mod responses_rules;
pub mod summary_calls;
pub mod tls;

use std::future::Future;
use std::time::Duration;

pub use binary::Binary;
pub use client::{
    body_bytes, channel_body, empty_body, full_body, raw_http1, ClientBody, ClientBodySender,
    Exchange, SseReader, TestClient,
};
pub use fixtures::{transcript, transcript_path, TRANSCRIPTS};
pub use metrics::metric_value;
pub use mock::{MockUpstream, Recorded, Reply, StreamSender};
pub use proxy::{upstream_toml, TestProxy};
pub use redis_server::RedisServer;
pub use tls::TestPki;

/// The default bound on any single await in a test: long enough for a loaded 2-core CI box,
/// short enough that a hang fails instead of stalling the suite.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Awaits `fut` or panics naming `what` after [`TIMEOUT`].
pub async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(TIMEOUT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {TIMEOUT:?} waiting for {what}"),
    }
}

/// Polls `check` until it returns `Some`, or panics naming `what` after [`TIMEOUT`].
/// The short pause between polls is a retry interval, not a synchronisation sleep.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {TIMEOUT:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A port on 127.0.0.1 that refuses every connection for as long as this lives: bound and
/// never listened on, so no other test's listener can take it meanwhile (a port merely
/// released can be, and then a test of an unreachable upstream talks to that listener).
pub struct RefusedPort {
    _socket: tokio::net::TcpSocket,
    port: u16,
}

impl RefusedPort {
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// See [`RefusedPort`].
pub fn refused_port() -> RefusedPort {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("address"))
        .expect("bind ephemeral port");
    let port = socket.local_addr().expect("local addr").port();
    RefusedPort {
        _socket: socket,
        port,
    }
}

/// A port on 127.0.0.1 with nothing listening: bound, then released (for a server of the
/// test's own to listen on; for an unreachable upstream see [`refused_port`]).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind ephemeral port");
    let port = listener.local_addr().expect("local addr").port();
    drop(listener);
    port
}

/// Deterministic pseudo-random bytes (xorshift), covering every byte value.
pub fn pseudo_random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
