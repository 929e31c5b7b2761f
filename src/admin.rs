//! The admin listener's endpoints: probes, metrics and sessions.
//!
//! - `GET /livez`, `GET /readyz`: probes (never need the token);
//! - `GET /metrics`: Prometheus text (store gauges refreshed at scrape time);
//! - `GET /models`: the context windows the trigger uses: learned from providers (newest
//!   first, with their source) and configured in `[models]`, and the default;
//! - `GET /sessions`: the sessions held, newest first;
//! - `GET /session/{id}`: one session's compaction count, covered messages, token figures,
//!   files and current summary;
//! - `GET /session/{id}/requests`: that session's recent requests as this process saw them
//!   (estimated tokens received and forwarded, the trigger, what was done to each);
//! - `POST /session/{id}/summarize` with an optional `{"instructions": "..."}`: compacts the
//!   latest request of that session now (manual compaction);
//! - `GET /ui`: the session inspector, a page built into the binary that reads the endpoints
//!   above (its own assets only: no CDN, no build step).
//!
//! Served on `server.admin_listen`, never on the proxy port, so operators can firewall it.
//! When `admin.token` is set, everything but the probes needs `Authorization: Bearer <token>`;
//! a browser opening the page, which cannot send that header, may give the token as
//! `/ui?token=...` (only there: the page then sends it as the header).

use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::json;

use crate::app::App;
use crate::pipeline::ManualOutcome;

/// Largest admin request body read (focus instructions).
const MAX_ADMIN_BODY: usize = 64 * 1024;

/// Most sessions listed by `GET /sessions`.
const MAX_LISTED_SESSIONS: usize = 1_000;

/// Serves one admin request.
pub async fn handle(app: Arc<App>, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_string();
    let probe = matches!(path.as_str(), "/livez" | "/readyz");
    let page_token = (path == "/ui")
        .then(|| query_token(request.uri()))
        .flatten();
    if !probe && !authorized(&app, &request, page_token.as_deref()) {
        return error(
            StatusCode::UNAUTHORIZED,
            "admin token required",
            "unauthorized",
        );
    }
    let method = request.method().clone();
    let session = path
        .strip_prefix("/session/")
        .map(|rest| rest.split_once('/').unwrap_or((rest, "")));
    match (&method, path.as_str(), session) {
        (&Method::GET, "/livez", _) => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        // Ready whatever the store's state: a degraded shared store is served around (fail
        // open), and taking every replica out of service because Redis is away would turn a
        // lost cache into an outage. The state is shown for operators.
        (&Method::GET, "/readyz", _) => ok_json(json!({
            "status": "ok",
            "store": app.pipeline.store().health(),
        })),
        (&Method::GET, "/metrics", _) => metrics(&app).await,
        (&Method::GET, "/models", _) => models(&app).await,
        (&Method::GET, "/sessions", _) => match app
            .pipeline
            .store()
            .list_sessions(MAX_LISTED_SESSIONS)
            .await
        {
            Ok(list) => ok_json(json!({ "sessions": list })),
            Err(e) => store_error(e),
        },
        (&Method::GET, "/ui", _) => {
            text(StatusCode::OK, UI_PAGE.into(), "text/html; charset=utf-8")
        }
        (&Method::GET, _, Some((id, "requests"))) => {
            ok_json(json!({ "points": app.pipeline.history().points(id) }))
        }
        (&Method::GET, _, Some((id, ""))) => match app.pipeline.store().session(id).await {
            Ok(Some(info)) => ok_json(json!(info)),
            Ok(None) => error(StatusCode::NOT_FOUND, "unknown session", "not_found"),
            Err(e) => store_error(e),
        },
        (&Method::POST, _, Some((id, "summarize"))) => {
            let id = id.to_string();
            // Bounded like a chat body: a client that stops sending must not hold one of the
            // admin listener's few connections (and with them `/livez`).
            let timeout = app.config.client_timeout();
            let instructions =
                match tokio::time::timeout(timeout, read_instructions(request.into_body())).await {
                    Ok(Ok(i)) => i,
                    Ok(Err(message)) => {
                        return error(StatusCode::BAD_REQUEST, &message, "invalid_request")
                    }
                    Err(_) => {
                        return error(
                            StatusCode::REQUEST_TIMEOUT,
                            "request body not received in time",
                            "request_timeout",
                        )
                    }
                };
            summarize(&app, &id, instructions.as_deref()).await
        }
        _ => error(StatusCode::NOT_FOUND, "not found", "not_found"),
    }
}

async fn metrics(app: &App) -> Response<Full<Bytes>> {
    // The store counts on its own; mirror its figures into the registry at scrape time.
    if let Ok(stats) = app.pipeline.store().stats().await {
        let m = &app.metrics;
        m.sessions
            .set(i64::try_from(stats.sessions).unwrap_or(i64::MAX));
        m.observe_store_evictions(stats.evictions.saturating_add(stats.expirations));
    }
    text(
        StatusCode::OK,
        app.metrics.render(),
        "text/plain; version=0.0.4; charset=utf-8",
    )
}

/// Learned windows first (they win over the table for their model), then the table.
async fn models(app: &App) -> Response<Full<Bytes>> {
    let learned = match app.pipeline.windows().await {
        Ok(learned) => learned,
        Err(e) => return store_error(e),
    };
    let learned = learned.into_iter().map(|(key, w)| {
        json!({
            "model": key.model(),
            "upstream": key.upstream(),
            "context_window": w.context_window,
            "source": w.source,
            "learned_unix": w.learned_unix,
        })
    });
    let configured = app.config.models.iter().map(|(model, m)| {
        json!({ "model": model, "context_window": m.context_window, "source": "configured" })
    });
    ok_json(json!({
        "default_context_window": app.config.compaction.default_context_window,
        "models": learned.chain(configured).collect::<Vec<_>>(),
    }))
}

async fn summarize(app: &App, id: &str, instructions: Option<&str>) -> Response<Full<Bytes>> {
    match app.pipeline.compact_session(id, instructions).await {
        ManualOutcome::UnknownSession => {
            error(StatusCode::NOT_FOUND, "unknown session", "not_found")
        }
        ManualOutcome::NotCompacted { reason } => {
            ok_json(json!({ "compacted": false, "session": id, "reason": reason }))
        }
        ManualOutcome::Compacted(checkpoint) => ok_json(json!({
            "compacted": true,
            "session": id,
            "compaction_num": checkpoint.result.compaction_num,
            "covered_messages": checkpoint.covered,
            "tokens_before": checkpoint.result.pre_tokens,
            "tokens_after": checkpoint.result.post_tokens,
            "read_files": checkpoint.result.read_files,
            "modified_files": checkpoint.result.modified_files,
            "summary": checkpoint.result.summary,
        })),
    }
}

/// The optional `{"instructions": "..."}` body; an empty body means none.
async fn read_instructions(body: Incoming) -> Result<Option<String>, String> {
    let bytes = Limited::new(body, MAX_ADMIN_BODY)
        .collect()
        .await
        .map_err(|e| format!("reading the body: {e}"))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        instructions: Option<String>,
    }
    let body: Body = serde_json::from_slice(&bytes)
        .map_err(|e| format!("expected {{\"instructions\": \"...\"}}: {e}"))?;
    Ok(body.instructions.filter(|i| !i.trim().is_empty()))
}

/// Whether the request carries the admin token (when one is set): as a bearer header, or as
/// `page_token` (the page's own `?token=`).
fn authorized<B>(app: &App, request: &Request<B>, page_token: Option<&str>) -> bool {
    let Some(token) = &app.config.admin.token else {
        return true;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or(page_token);
    presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.as_bytes()))
}

/// The `token` query parameter, percent-decoded.
fn query_token(uri: &http::Uri) -> Option<String> {
    let query = uri.query()?;
    let raw = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("token="))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The session inspector page (`/ui`), built into the binary.
const UI_PAGE: &str = include_str!("admin/ui.html");

/// Compares without an early exit, so response timing does not reveal the token's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn store_error(e: crate::session::StoreError) -> Response<Full<Bytes>> {
    tracing::warn!(error = %e, "session store unavailable");
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "session store unavailable",
        "store_unavailable",
    )
}

fn text(status: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn ok_json(value: serde_json::Value) -> Response<Full<Bytes>> {
    text(StatusCode::OK, value.to_string(), "application/json")
}

fn error(status: StatusCode, message: &str, code: &str) -> Response<Full<Bytes>> {
    crate::error::error_response(status, message, "admin_error", code)
}

#[cfg(test)]
mod tests {
    use super::{constant_time_eq, query_token};

    #[test]
    fn the_page_token_is_read_from_its_query() {
        let token = |uri: &str| query_token(&uri.parse().expect("uri"));
        assert_eq!(token("/ui?token=abc"), Some("abc".into()));
        assert_eq!(token("/ui?x=1&token=a%2Fb%3D+c"), Some("a/b= c".into()));
        assert_eq!(token("/ui?tokens=abc"), None);
        assert_eq!(token("/ui"), None);
        assert_eq!(token("/ui?token=%zz"), None, "not percent-encoding");
        assert_eq!(
            token("/ui?token=%4"),
            Some("%4".into()),
            "a lone % at the end stays"
        );
    }

    #[test]
    fn token_comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
