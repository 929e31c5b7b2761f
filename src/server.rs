//! Listeners and lifecycle: binds the proxy and admin sockets, accepts connections (HTTP/1.1
//! and cleartext HTTP/2 on the same port, optionally behind TLS), and shuts down gracefully.
//!
//! Shutdown follows one path whatever triggers it: stop accepting (the listeners are dropped,
//! so new connections are refused), abandon the summaries being made in the background, ask
//! every open connection to finish its in-flight requests and streams, and wait at most
//! `server.shutdown_grace_secs` for them.
//!
//! A client is bounded in both directions by `server.client_timeout_secs`: sending a request
//! (hyper's header timeout, the body reader's), sitting idle, and reading its answer (a write
//! that makes no progress for that long ends the connection: `server::send_timeout`). So no client
//! holds a slot, or shutdown, longer than that without making progress. A client that
//! half-closes after its request (shuts down its write side) still gets its whole answer.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use crate::app::{App, AppHandle};
use crate::config::Config;
use crate::error::Error;
use crate::{admin, proxy};

mod activity;
mod send_timeout;
mod slots;

use send_timeout::SendTimeout;
use slots::{Reserved, Slot, Slots};

/// Connections the admin listener holds at most, apart from the proxy's: a proxy full of
/// clients never keeps `/livez` from answering, and a full admin listener closes its
/// longest-idle connection to serve the next ([`slots`]).
const ADMIN_CONNECTIONS: usize = 16;

/// File descriptors kept for everything but client connections (listeners, upstream
/// connections, the summarizer's, files) when `server.max_connections` is fitted to the limit.
const RESERVED_FDS: u64 = 256;

/// A bound, not yet running compactor.
pub struct Server {
    app: Arc<AppHandle>,
    proxy: TcpListener,
    admin: TcpListener,
    tls: Option<TlsAcceptor>,
}

/// Which listener a connection came in on.
#[derive(Clone, Copy)]
enum Listener {
    Proxy,
    Admin,
}

impl Listener {
    /// For logs.
    fn name(self) -> &'static str {
        match self {
            Listener::Proxy => "proxy",
            Listener::Admin => "admin",
        }
    }
}

impl Server {
    /// Builds the app and binds both listeners (port 0 picks a free port).
    pub async fn bind(config: Config) -> Result<Server, Error> {
        let tls = match (&config.server.tls_cert, &config.server.tls_key) {
            (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
            _ => None,
        };
        let listen = |addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen { addr, source })
        };
        let proxy = listen(config.server.listen).await?;
        let admin = listen(config.server.admin_listen).await?;
        let app = Arc::new(AppHandle::new(App::new(config)?));
        Ok(Server {
            app,
            proxy,
            admin,
            tls,
        })
    }

    /// The proxy listener's address.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy
            .local_addr()
            .unwrap_or_else(|_| self.app.current().config.server.listen)
    }

    /// The admin listener's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .unwrap_or_else(|_| self.app.current().config.server.admin_listen)
    }

    /// The current application state (metrics, engine), e.g. for tests.
    pub fn app(&self) -> Arc<App> {
        self.app.current()
    }

    /// The swappable app, for hot reload.
    pub fn handle(&self) -> Arc<AppHandle> {
        self.app.clone()
    }

    /// Serves until `shutdown` completes, then drains.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        let Server {
            app,
            proxy,
            admin,
            tls,
        } = self;
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // Half-close: a client that shuts down its write side after its request is waiting
        // for the answer, not gone (without this hyper ends the exchange at the EOF).
        builder.http1().timer(TokioTimer::new()).half_close(true);
        // WebSockets over HTTP/2 (RFC 8441 extended CONNECT), tunnelled as upgrades are.
        builder.http2().enable_connect_protocol();
        let max_connections = connection_limit(app.current().config.server.max_connections);
        let proxy_slots = Slots::new(max_connections, false);
        let admin_slots = Slots::new(ADMIN_CONNECTIONS, true);
        // Every connection holds a sender; the drain ends when the last one is dropped.
        let (drain_tx, mut drain_rx) = mpsc::channel::<()>(1);
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        tracing::info!(addr = %proxy.local_addr()?, tls = tls.is_some(), max_connections, "proxy listening");
        tracing::info!(addr = %admin.local_addr()?, "admin listening");

        tokio::pin!(shutdown);
        loop {
            // A full proxy waits for a slot before accepting (the kernel's backlog holds the
            // rest); the admin listener keeps accepting meanwhile, and when full makes room.
            // Both arms are cancel-safe: a slot taken by an arm that loses the race is
            // returned when it is dropped.
            let (stream, peer, listener, slot) = tokio::select! {
                () = &mut shutdown => break,
                (slot, accepted) = accept(&proxy, &proxy_slots) => match accepted {
                    Ok((s, p)) => (s, p, Listener::Proxy, slot),
                    Err(e) => { accept_failed(e).await; continue; }
                },
                (slot, accepted) = accept(&admin, &admin_slots) => match accepted {
                    Ok((s, p)) => (s, p, Listener::Admin, slot),
                    Err(e) => { accept_failed(e).await; continue; }
                },
            };
            let _ = stream.set_nodelay(true);
            let tls = match listener {
                Listener::Proxy => tls.clone(),
                Listener::Admin => None,
            };
            // Read per connection, so a reloaded `server.client_timeout_secs` applies to the
            // connections accepted after it.
            let client_timeout = app.current().config.client_timeout();
            let mut builder = builder.clone();
            builder.http1().header_read_timeout(client_timeout);
            let connection = Connection {
                app: app.clone(),
                builder,
                shutdown: shutdown_rx.clone(),
                client_timeout,
                slot: slot.occupy(),
                _drain: drain_tx.clone(),
            };
            tokio::spawn(connection.serve(stream, peer, listener, tls));
        }

        drop(proxy);
        drop(admin);
        // Summaries made ahead of need are not worth holding shutdown for: abandoned at once
        // (requests waiting for one are released and forwarded as they can be).
        app.current().pipeline.abandon_background();
        let grace = app.current().config.shutdown_grace();
        tracing::info!(
            connections = proxy_slots.taken(),
            grace_secs = grace.as_secs_f64(),
            "shutting down: draining"
        );
        let _ = shutdown_tx.send(true);
        // Tunnels (WebSockets) have no end of their own, and one over HTTP/2 is a stream of a
        // connection the drain would wait for: closed now (their clients reconnect elsewhere
        // or fall back to HTTP), while requests in progress get the grace.
        let tunnels = app.current().tunnels.close_all();
        if tunnels > 0 {
            tracing::info!(tunnels, "tunnels closed");
        }
        drop(drain_tx);
        match tokio::time::timeout(grace, drain_rx.recv()).await {
            Ok(_) => tracing::info!("drain complete: every connection finished"),
            Err(_) => tracing::warn!("drain timed out: closing the remaining connections"),
        }
        Ok(())
    }
}

/// Waits for a free slot, then accepts one connection.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Slots>,
) -> (Reserved, std::io::Result<(TcpStream, SocketAddr)>) {
    let slot = slots.reserve().await;
    (slot, listener.accept().await)
}

/// `server.max_connections`, lowered to what the file-descriptor limit allows after raising the
/// soft limit to the hard one (logged: a proxy that runs out of descriptors refuses everyone).
fn connection_limit(configured: usize) -> usize {
    let fds = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the file-descriptor limit");
            return configured;
        }
    };
    let fitting = fds
        .saturating_sub(RESERVED_FDS + ADMIN_CONNECTIONS as u64)
        // Each proxied request may hold an upstream connection beside the client's.
        / 2;
    let limit = configured
        .min(usize::try_from(fitting).unwrap_or(usize::MAX))
        .max(1);
    if limit < configured {
        tracing::warn!(
            file_descriptors = fds,
            configured,
            max_connections = limit,
            "server.max_connections lowered to fit the file-descriptor limit"
        );
    } else {
        tracing::info!(file_descriptors = fds, "file-descriptor limit");
    }
    limit
}

/// One client connection and what it holds: a slot of its listener and a drain sender, both
/// released when it ends.
struct Connection {
    app: Arc<AppHandle>,
    builder: auto::Builder<TokioExecutor>,
    shutdown: watch::Receiver<bool>,
    client_timeout: Duration,
    slot: Slot,
    _drain: mpsc::Sender<()>,
}

impl Connection {
    async fn serve(
        self,
        stream: TcpStream,
        peer: SocketAddr,
        listener: Listener,
        tls: Option<TlsAcceptor>,
    ) {
        // Under TLS too, so the handshake's writes and close_notify are bounded as well.
        let app = self.app.clone();
        let stream = SendTimeout::new(stream, self.client_timeout, move || {
            let listener = listener.name();
            tracing::info!(%peer, listener, "client stopped reading: connection closed");
            app.current().metrics.client_send_timeout();
        });
        let result = match tls {
            None => self.serve_io(TokioIo::new(stream), peer, listener).await,
            Some(acceptor) => {
                let accepted =
                    tokio::time::timeout(self.client_timeout, acceptor.accept(stream)).await;
                match accepted {
                    Ok(Ok(s)) => self.serve_io(TokioIo::new(s), peer, listener).await,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                }
            }
        };
        if let Err(e) = result {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    }

    /// Serves HTTP on `io` until the client closes, the connection has been idle (no request
    /// in progress) for `client_timeout`, or shutdown; the last two close it gracefully
    /// (requests in progress finish; HTTP/2 gets a GOAWAY). A full admin listener asking for
    /// the slot closes it at once if idle, else gracefully.
    async fn serve_io<I>(
        mut self,
        io: I,
        peer: SocketAddr,
        listener: Listener,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let activity = self.slot.activity().clone();
        let app = self.app.clone();
        let requests = activity.clone();
        let service = service_fn(move |request| {
            let app = app.current();
            let active = requests.start();
            async move {
                let response = match listener {
                    Listener::Proxy => proxy::handle(app, request, peer).await,
                    Listener::Admin => admin::handle(app, request).await.map(|b| {
                        use http_body_util::BodyExt;
                        b.map_err(|never| match never {}).boxed_unsync()
                    }),
                };
                // The request is in progress until its response body has been sent.
                Ok::<_, std::convert::Infallible>(response.map(|body| active.holding(body)))
            }
        });
        let conn = self.builder.serve_connection_with_upgrades(io, service);
        tokio::pin!(conn);
        let idle = tokio::time::sleep(self.client_timeout);
        tokio::pin!(idle);
        let mut closing = false;
        loop {
            tokio::select! {
                // The connection first: a request already received starts before a request for
                // the slot is looked at.
                biased;
                result = conn.as_mut() => return result,
                () = self.slot.close_requested() => {
                    if activity.idle_since().is_some() {
                        tracing::debug!(%peer, "idle connection closed to make room");
                        return Ok(());
                    }
                    if !closing {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                        idle.as_mut().reset(Instant::now() + self.client_timeout);
                    }
                }
                changed = self.shutdown.changed(), if !closing => {
                    // A closed channel means the server is gone: close too.
                    if changed.is_err() || *self.shutdown.borrow() {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                        idle.as_mut().reset(Instant::now() + self.client_timeout);
                    }
                }
                () = idle.as_mut() => {
                    let deadline = activity.idle_deadline(self.client_timeout);
                    match deadline {
                        // Closing and still no request in progress a timeout later: a client
                        // that does not finish the close (an HTTP/2 peer that never answers
                        // the GOAWAY's ping) is dropped.
                        Some(_) if closing => return Ok(()),
                        Some(deadline) if deadline <= Instant::now() => {
                            tracing::debug!(%peer, "idle connection closed");
                            closing = true;
                            conn.as_mut().graceful_shutdown();
                            idle.as_mut().reset(Instant::now() + self.client_timeout);
                        }
                        Some(deadline) => idle.as_mut().reset(deadline),
                        None => idle.as_mut().reset(Instant::now() + self.client_timeout),
                    }
                }
            }
        }
    }
}

/// Accept errors (e.g. out of file descriptors) are transient: log and back off briefly so a
/// persistent one does not spin the loop.
async fn accept_failed(e: std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

fn tls_acceptor(cert: &std::path::Path, key: &std::path::Path) -> Result<TlsAcceptor, Error> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| Error::Tls(format!("server.tls_cert {}: {e}", cert.display())))?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| Error::Tls(format!("server.tls_key {}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| Error::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
