//! The admin listener's endpoints: `/livez`, `/readyz` and `/metrics`.
//!
//! Served on `server.admin_listen`, never on the proxy port, so operators can firewall it.
//! When `admin.token` is set, everything but the probes needs `Authorization: Bearer <token>`.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;

use crate::app::App;

/// Serves one admin request.
pub async fn handle<B>(app: Arc<App>, request: Request<B>) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    let probe = matches!(path, "/livez" | "/readyz");
    if !probe && !authorized(&app, &request) {
        return json(
            StatusCode::UNAUTHORIZED,
            r#"{"error":{"message":"admin token required","type":"authentication_error","code":"unauthorized"}}"#,
        );
    }
    match (request.method(), path) {
        (&Method::GET, "/livez") | (&Method::GET, "/readyz") => {
            text(StatusCode::OK, "ok\n", "text/plain")
        }
        (&Method::GET, "/metrics") => text(
            StatusCode::OK,
            &app.metrics.render(),
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        _ => json(
            StatusCode::NOT_FOUND,
            r#"{"error":{"message":"not found","type":"invalid_request_error","code":"not_found"}}"#,
        ),
    }
}

fn authorized<B>(app: &App, request: &Request<B>) -> bool {
    let Some(token) = &app.config.admin.token else {
        return true;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.as_bytes()))
}

/// Compares without an early exit, so response timing does not reveal the token's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn text(status: StatusCode, body: &str, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn json(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    text(status, body, "application/json")
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn token_comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
