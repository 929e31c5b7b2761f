//! Listeners and lifecycle: binds the proxy and admin sockets, accepts connections (HTTP/1.1
//! and cleartext HTTP/2 on the same port, optionally behind TLS), and shuts down gracefully.
//!
//! Shutdown follows one path whatever triggers it: stop accepting (the listeners are dropped,
//! so new connections are refused), abandon the summaries being made in the background, ask
//! every open connection to finish its in-flight requests and streams, and wait at most
//! `server.shutdown_grace_secs` for them.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::app::{App, AppHandle};
use crate::config::Config;
use crate::error::Error;
use crate::{admin, proxy};

/// How long a client may take to send request headers or finish a TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

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

impl Server {
    /// Builds the app and binds both listeners (port 0 picks a free port).
    pub async fn bind(config: Config) -> Result<Server, Error> {
        let tls = match (&config.server.tls_cert, &config.server.tls_key) {
            (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
            _ => None,
        };
        let proxy = TcpListener::bind(config.server.listen).await?;
        let admin = TcpListener::bind(config.server.admin_listen).await?;
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
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(HANDSHAKE_TIMEOUT);
        let graceful = GracefulShutdown::new();
        tracing::info!(addr = %proxy.local_addr()?, tls = tls.is_some(), "proxy listening");
        tracing::info!(addr = %admin.local_addr()?, "admin listening");

        tokio::pin!(shutdown);
        loop {
            let (stream, peer, listener) = tokio::select! {
                () = &mut shutdown => break,
                accepted = proxy.accept() => match accepted {
                    Ok((s, p)) => (s, p, Listener::Proxy),
                    Err(e) => { accept_failed(e).await; continue; }
                },
                accepted = admin.accept() => match accepted {
                    Ok((s, p)) => (s, p, Listener::Admin),
                    Err(e) => { accept_failed(e).await; continue; }
                },
            };
            let _ = stream.set_nodelay(true);
            let tls = match listener {
                Listener::Proxy => tls.clone(),
                Listener::Admin => None,
            };
            tokio::spawn(serve_connection(
                app.clone(),
                builder.clone(),
                graceful.watcher(),
                stream,
                peer,
                listener,
                tls,
            ));
        }

        drop(proxy);
        drop(admin);
        // Summaries made ahead of need are not worth holding shutdown for: abandoned at once
        // (requests waiting for one are released and forwarded as they can be).
        app.current().compactor.abandon_background();
        let grace = app.current().config.shutdown_grace();
        tracing::info!(
            connections = graceful.count(),
            grace_secs = grace.as_secs_f64(),
            "shutting down: draining"
        );
        match tokio::time::timeout(grace, graceful.shutdown()).await {
            Ok(()) => tracing::info!("drain complete: every connection finished"),
            Err(_) => tracing::warn!("drain timed out: closing the remaining connections"),
        }
        Ok(())
    }
}

async fn serve_connection(
    app: Arc<AppHandle>,
    builder: auto::Builder<TokioExecutor>,
    watcher: hyper_util::server::graceful::Watcher,
    stream: TcpStream,
    peer: SocketAddr,
    listener: Listener,
    tls: Option<TlsAcceptor>,
) {
    let service = service_fn(move |request| {
        let app = app.current();
        async move {
            Ok::<_, std::convert::Infallible>(match listener {
                Listener::Proxy => proxy::handle(app, request, peer).await,
                Listener::Admin => admin::handle(app, request).await.map(|b| {
                    use http_body_util::BodyExt;
                    b.map_err(|never| match never {}).boxed_unsync()
                }),
            })
        }
    });
    let result = match tls {
        None => {
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            watcher.watch(conn.into_owned()).await
        }
        Some(acceptor) => {
            let stream =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            watcher.watch(conn.into_owned()).await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
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
