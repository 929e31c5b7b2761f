//! compactor started in-process on `127.0.0.1:0` (proxy and admin listeners).

use std::net::SocketAddr;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::client::TestClient;
use super::metrics::metric_value;
use super::within;

/// `[upstream]\nbase_url = "<base_url>"\n`
pub fn upstream_toml(base_url: &str) -> String {
    format!("[upstream]\nbase_url = \"{base_url}\"\n")
}

/// A running proxy. Dropping it without [`TestProxy::shutdown`] triggers shutdown and leaves
/// the drain to the runtime.
pub struct TestProxy {
    /// Proxy listener.
    pub addr: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), compactor::error::Error>>>,
    client: TestClient,
}

impl TestProxy {
    /// Parses `toml` over the defaults, listens on `127.0.0.1:0` for both listeners, runs.
    pub async fn start(toml: &str) -> TestProxy {
        let config = compactor::Config::from_toml(toml)
            .unwrap_or_else(|e| panic!("test config rejected: {e}\n{toml}"));
        TestProxy::start_with(config).await
    }

    /// Runs the given configuration with both listeners moved to `127.0.0.1:0`.
    pub async fn start_with(mut config: compactor::Config) -> TestProxy {
        config.server.listen = "127.0.0.1:0".parse().expect("addr");
        config.server.admin_listen = "127.0.0.1:0".parse().expect("addr");
        let server = within("proxy bind", compactor::Server::bind(config))
            .await
            .unwrap_or_else(|e| panic!("proxy failed to bind: {e}"));
        let addr = server.proxy_addr();
        let admin = server.admin_addr();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        TestProxy {
            addr,
            admin,
            shutdown: Some(tx),
            task: Some(task),
            client: TestClient::http1(),
        }
    }

    /// `http://<proxy addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `https://127.0.0.1:<port><path>` (for a proxy with inbound TLS).
    pub fn https_url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }

    /// `http://<admin addr><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// The `/metrics` text; panics unless it answers 200.
    pub async fn metrics(&self) -> String {
        let (status, text) = self.client.get_text(&self.admin_url("/metrics")).await;
        assert_eq!(status, 200, "GET /metrics: {text}");
        text
    }

    /// One sample from `/metrics` (exact label set).
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        metric_value(&self.metrics().await, name, labels)
    }

    /// Polls `/metrics` until the sample is exported and equals `expected` (a missing sample
    /// never matches, so a renamed metric cannot pass as 0); panics with the last value seen
    /// after the test timeout.
    pub async fn wait_metric(&self, name: &str, labels: &[(&str, &str)], expected: f64) {
        let deadline = tokio::time::Instant::now() + super::TIMEOUT;
        loop {
            let v = self.metric(name, labels).await;
            if v == Some(expected) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}{labels:?}: expected {expected}, still {v:?} after {:?}",
                super::TIMEOUT
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Triggers shutdown without waiting for the drain.
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// The server task, to await the end of the drain yourself (after `trigger_shutdown`).
    pub fn take_task(&mut self) -> JoinHandle<Result<(), compactor::error::Error>> {
        self.task.take().expect("server task already taken")
    }

    /// Triggers shutdown and waits (bounded) for `run` to return; panics if it returned an error.
    pub async fn shutdown(mut self) {
        self.trigger_shutdown();
        let task = self.take_task();
        within("proxy drain", task)
            .await
            .expect("server task panicked")
            .expect("server run returned an error");
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        self.trigger_shutdown();
    }
}
