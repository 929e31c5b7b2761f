//! Connection upgrades (WebSocket) tunnelled to the upstream.
//!
//! A transparent proxy passes an HTTP/1.1 `Upgrade` on: Codex, for one, opens
//! `GET /v1/responses` as a WebSocket before it falls back to HTTP, and a proxy that drops the
//! upgrade costs it seconds of reconnect attempts. The request goes upstream with its
//! `Upgrade` and `Connection: upgrade` headers (the only hop-by-hop headers kept); a `101`
//! answer is passed back and the two upgraded connections are joined byte for byte until
//! either side closes. Any other answer is passed back as it came. Nothing inside a tunnel is
//! read: a WebSocket's messages pass through uncompacted (README says so).
//!
//! HTTP/2 has no `Upgrade`: a WebSocket over HTTP/2 is an extended CONNECT (RFC 8441,
//! `:protocol = websocket`), which the proxy listener accepts. It goes upstream as the
//! HTTP/1.1 upgrade a WebSocket server takes everywhere (a `GET` with `Upgrade`, a fresh
//! `Sec-WebSocket-Key`, `Sec-WebSocket-Version: 13` unless the client named one), and a `101`
//! comes back to the client as the `200` that opens its stream; the frames are the same on
//! both. Upgrades always go upstream over HTTP/1.1, on connections of their own
//! ([`crate::upstream::Upstream::send_upgrade`]): one the pool negotiated as HTTP/2 could not
//! carry them.
//!
//! Tunnels outlive the request that opened them, and the client connection's slot ends with
//! the upgrade, so they have a bound of their own (`server.max_connections` at once; past it an
//! upgrade is forwarded as a plain request and the client falls back) and shutdown closes
//! them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http::header::{self, HeaderValue};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use base64::Engine as _;
use http::Method;
use ring::rand::SecureRandom as _;

use super::{counted, send};
use crate::app::App;
use crate::error::Error;
use crate::metrics::TunnelOutcome;
use crate::timing::Overhead;
use crate::upstream::{strip_hop_by_hop, BoxError, ProxyBody};

/// Whether a request asks to switch protocols (`Connection: upgrade` and an `Upgrade` header).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Whether a request opens a tunnel: an HTTP/1.1 upgrade, or an HTTP/2 extended CONNECT.
pub fn wants_tunnel<B>(request: &Request<B>) -> bool {
    is_upgrade(request.headers()) || extended_connect(request).is_some()
}

/// The protocol an HTTP/2 extended CONNECT asks for (`websocket`), if it is one.
fn extended_connect<B>(request: &Request<B>) -> Option<&hyper::ext::Protocol> {
    (request.method() == Method::CONNECT)
        .then(|| request.extensions().get::<hyper::ext::Protocol>())
        .flatten()
}

/// A new `Sec-WebSocket-Key`: 16 random bytes, base64 (RFC 6455, 4.1).
fn websocket_key() -> Option<HeaderValue> {
    let mut nonce = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut nonce).ok()?;
    HeaderValue::from_str(&base64::engine::general_purpose::STANDARD.encode(nonce)).ok()
}

/// The tunnels open now (shared by every app a reload makes, so shutdown reaches them all).
#[derive(Debug)]
pub struct Tunnels {
    permits: Arc<Semaphore>,
    tasks: Mutex<JoinSet<()>>,
    closed: AtomicBool,
}

impl Tunnels {
    /// Room for `max_open` tunnels at once (at least one).
    pub fn new(max_open: usize) -> Arc<Tunnels> {
        Arc::new(Tunnels {
            permits: Arc::new(Semaphore::new(max_open.max(1))),
            tasks: Mutex::new(JoinSet::new()),
            closed: AtomicBool::new(false),
        })
    }

    fn tasks(&self) -> MutexGuard<'_, JoinSet<()>> {
        // The set is only spawned into, reaped and aborted: valid after any panic.
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Shutdown: closes every tunnel and opens no more. Returns how many were open.
    pub fn close_all(&self) -> usize {
        self.closed.store(true, Ordering::Release);
        let mut tasks = self.tasks();
        while tasks.try_join_next().is_some() {}
        let open = tasks.len();
        tasks.abort_all();
        open
    }
}

/// Forwards an upgrade request (headers prepared, `Upgrade` and `Connection` stripped with
/// the other hop-by-hop headers; an extended CONNECT already made a `GET`) and, when the
/// upstream switches protocols, joins the two connections. `client` is the original request,
/// still holding its upgrade.
pub async fn forward(
    app: &App,
    mut client: Request<Incoming>,
    mut upstream: Request<ProxyBody>,
    overhead: &mut Overhead,
) -> Result<Response<ProxyBody>, Error> {
    let tunnels = &app.tunnels;
    let permit = match tunnels.permits.clone().try_acquire_owned() {
        Ok(permit) if !tunnels.closed.load(Ordering::Acquire) => permit,
        _ => {
            // No room: forwarded as a plain request; the client falls back to HTTP.
            app.metrics.tunnel(TunnelOutcome::Busy);
            return Ok(passed(send(app, upstream, overhead).await?));
        }
    };
    let over_h2 = extended_connect(&client).is_some();
    let upgrade = match extended_connect(&client) {
        Some(protocol) => HeaderValue::from_str(protocol.as_str()).ok(),
        None => client.headers().get(header::UPGRADE).cloned(),
    };
    if let Some(protocol) = &upgrade {
        let headers = upstream.headers_mut();
        headers.insert(header::UPGRADE, protocol.clone());
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if over_h2 && protocol.as_bytes().eq_ignore_ascii_case(b"websocket") {
            // HTTP/2 WebSockets carry no key (RFC 8441, 5): the HTTP/1.1 handshake needs one.
            if let Some(key) = websocket_key() {
                headers.insert(header::SEC_WEBSOCKET_KEY, key);
            }
            headers
                .entry(header::SEC_WEBSOCKET_VERSION)
                .or_insert(HeaderValue::from_static("13"));
        }
    }
    let client_side = hyper::upgrade::on(&mut client);
    let uri = upstream.uri().clone();
    let mut answer = counted(
        app,
        overhead.wait(app.upstream.send_upgrade(upstream)).await,
        &uri,
    )?;
    if answer.status() != StatusCode::SWITCHING_PROTOCOLS {
        app.metrics.tunnel(TunnelOutcome::Refused);
        return Ok(passed(answer));
    }
    let upstream_side = hyper::upgrade::on(&mut answer);
    let (mut parts, _) = answer.into_parts();
    let switched_to = parts.headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut parts.headers);
    if over_h2 {
        // The stream is open once the CONNECT is answered 2xx; the key's proof belongs to
        // the HTTP/1.1 handshake alone.
        parts.status = StatusCode::OK;
        parts.headers.remove(header::SEC_WEBSOCKET_ACCEPT);
    } else {
        if let Some(protocol) = switched_to.or(upgrade) {
            parts.headers.insert(header::UPGRADE, protocol);
        }
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }

    let metrics = app.metrics.clone();
    let path = client.uri().path().to_string();
    let mut tasks = tunnels.tasks();
    while tasks.try_join_next().is_some() {}
    tasks.spawn(async move {
        let _permit = permit;
        let joined = match tokio::try_join!(client_side, upstream_side) {
            Ok(sides) => sides,
            Err(e) => {
                metrics.tunnel(TunnelOutcome::Failed);
                tracing::warn!(path, error = %e, "upgrade not completed; tunnel not opened");
                return;
            }
        };
        metrics.tunnel(TunnelOutcome::Opened);
        let _open = metrics.tunnel_open();
        tracing::info!(path, "tunnel opened");
        let (mut client_io, mut upstream_io) = (TokioIo::new(joined.0), TokioIo::new(joined.1));
        match tokio::io::copy_bidirectional(&mut client_io, &mut upstream_io).await {
            Ok((sent, received)) => tracing::info!(path, sent, received, "tunnel closed"),
            Err(e) => tracing::info!(path, error = %e, "tunnel closed"),
        }
    });
    let body = Empty::new().map_err(|never| match never {}).boxed_unsync();
    Ok(Response::from_parts(parts, body))
}

/// An upstream answer passed back as it came, minus hop-by-hop headers.
fn passed(answer: Response<Incoming>) -> Response<ProxyBody> {
    let (mut parts, body) = answer.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(BoxError::from).boxed_unsync())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upgrade_needs_both_headers_and_the_token_in_any_case_or_list() {
        let headers = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                    HeaderValue::from_str(v).expect("value"),
                );
            }
            h
        };
        assert!(is_upgrade(&headers(&[
            ("upgrade", "websocket"),
            ("connection", "Upgrade")
        ])));
        assert!(is_upgrade(&headers(&[
            ("upgrade", "websocket"),
            ("connection", "keep-alive, upgrade")
        ])));
        assert!(!is_upgrade(&headers(&[("upgrade", "websocket")])));
        assert!(!is_upgrade(&headers(&[("connection", "upgrade")])));
        assert!(!is_upgrade(&headers(&[("connection", "keep-alive")])));
    }
}
