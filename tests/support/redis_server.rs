//! A real `redis-server` for the tests, on a free port of 127.0.0.1, with no persistence.
//!
//! Tests that need it fail loudly when Debian's `redis-server` is missing (`.ci/run` installs
//! it). The server can be killed and started again on the same port, to test a store that
//! goes away mid-run and comes back.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::eventually;

/// A running `redis-server`, killed when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers `PING`.
    pub async fn start() -> RedisServer {
        let port = super::closed_port();
        let mut server = RedisServer { port, child: None };
        server.restart().await;
        server
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL: nothing is saved, connections drop).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: it persists nothing).
    pub async fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start redis-server ({e}): these tests need Debian's redis-server \
                     (apt-get install redis-server; .ci/run installs it)"
                )
            });
        self.child = Some(child);
        let url = self.url();
        eventually("redis-server to answer PING", || {
            let url = url.clone();
            async move { ping(&url).await.then_some(()) }
        })
        .await;
    }

    /// A connection for the test's own checks.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test redis-server")
    }

    /// Every key and every string value stored (for checks that no secret reached Redis).
    pub async fn dump(&self) -> Vec<(String, Vec<u8>)> {
        let mut conn = self.connection().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        let mut out = Vec::new();
        for key in keys {
            let kind: String = redis::cmd("TYPE")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("TYPE");
            let read = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).clone(),
                "hash" => redis::cmd("HGETALL").arg(&key).clone(),
                "list" | "zset" => {
                    let range = if kind == "list" { "LRANGE" } else { "ZRANGE" };
                    redis::cmd(range).arg(&key).arg(0).arg(-1).clone()
                }
                _ => continue,
            };
            // Every reply flattened to its bytes (a string, or the parts of a collection).
            let value: redis::Value = read.query_async(&mut conn).await.expect("read value");
            let value = flatten(value);
            out.push((key, value));
        }
        out
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The bytes of a reply: a bulk string, or the concatenation of a collection's parts.
fn flatten(value: redis::Value) -> Vec<u8> {
    match value {
        redis::Value::BulkString(bytes) => bytes,
        redis::Value::Array(parts) | redis::Value::Set(parts) => {
            parts.into_iter().flat_map(flatten).collect()
        }
        redis::Value::Map(pairs) => pairs
            .into_iter()
            .flat_map(|(k, v)| [flatten(k), flatten(v)].concat())
            .collect(),
        redis::Value::SimpleString(text) => text.into_bytes(),
        _ => Vec::new(),
    }
}

async fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let connect = client.get_multiplexed_async_connection();
    let Ok(Ok(mut conn)) = tokio::time::timeout(Duration::from_secs(1), connect).await else {
        return false;
    };
    redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .is_ok()
}
