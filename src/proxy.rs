//! The request path: the only place that orders the steps of a proxied request.
//!
//! 1. classify: resolve the route and recognise chat endpoints (dialect by path);
//! 2. prepare: strip hop-by-hop headers, set `Host`, append `X-Forwarded-For`;
//! 3. compact (chat calls only): read the body within `server.max_body_bytes`, let the engine
//!    decide, forward the rewritten body or the original bytes (fail open);
//! 4. send upstream with the response-head timeout;
//! 5. refusal (chat calls that could be sent again): an error status is read as far as telling
//!    a refusal for length, a `200` event stream is held until its first content event
//!    ([`stream_hold`]); a refusal is compacted and sent once more, and the client gets only
//!    the second answer;
//! 6. respond: stream the upstream body back untouched, minus hop-by-hop headers, plus the
//!    `x-compactor-*` headers; chat responses are watched for the provider's `usage` as frames
//!    pass (metrics, calibration); record metrics once the head is out (including compactor's
//!    own overhead: the time not spent waiting on the upstream or the summarizer) and keep the
//!    in-flight gauge up until the body is finished or dropped.
//!
//! Everything else (bodies of non-chat calls, every response body) streams frame by frame.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use compactor_plugin_api::Caller;
use futures_util::FutureExt as _;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body, Frame, Incoming};

use crate::app::App;
use crate::cohort::Cohort;
use crate::compaction::models::{enables_long_context, window_model, WindowSource};
use crate::compaction::Attempts;
use crate::config::Mode;
use crate::dialect::DialectKind;
use crate::error::Error;
use crate::metrics::{method_label, route_label, Metrics, RefusalVia, UpstreamErrorKind};
use crate::overflow::Overflow;
use crate::pipeline::{ForwardedEstimate, Outcome, Processed, RequestContext};
use crate::session::{ProviderAnswer, SessionCost, TenantId};
use crate::timing::Overhead;
use crate::upstream::{
    origin, prepare_headers, strip_hop_by_hop, BoxError, ProxyBody, Resolved, SendError,
};
use crate::usage::{self, Encoding, Format, Observed, Usage};

pub mod body_pool;
mod client_body;
pub mod stream_hold;
pub mod tunnel;

/// Response header: whether the forwarded request carries a summary, new or reused.
pub const HEADER_COMPACTED: HeaderName = HeaderName::from_static("x-compactor-compacted");
/// `true` when the provider refused the request for its length and the response answers the
/// compacted request sent again.
pub const HEADER_RETRIED: HeaderName = HeaderName::from_static("x-compactor-retried");
/// Response header: the conversation's session id.
pub const HEADER_SESSION: HeaderName = HeaderName::from_static("x-compactor-session");
/// Request header: `off`, `shadow` or `enforce` for this request, whatever the configuration
/// and the sample say (a client or a gateway opting a request out, or into shadow). Never
/// forwarded.
pub const HEADER_MODE: HeaderName = HeaderName::from_static("x-compactor-mode");
/// Response header: estimated input tokens as received.
pub const HEADER_TOKENS_BEFORE: HeaderName = HeaderName::from_static("x-compactor-tokens-before");
/// Response header: estimated input tokens as forwarded.
pub const HEADER_TOKENS_AFTER: HeaderName = HeaderName::from_static("x-compactor-tokens-after");
/// Response header: the 1-based number of the compaction whose summary was forwarded.
pub const HEADER_COMPACTION_NUM: HeaderName = HeaderName::from_static("x-compactor-compaction-num");

/// Request headers whose values are credentials: handed to summarizers that call the caller's
/// own provider, never logged. Gemini's key may come as the `key` query parameter instead; it
/// is handed on as `x-goog-api-key` ([`GEMINI_KEY_PARAMETER`]).
const CREDENTIAL_HEADERS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-goog-api-key"),
];

/// The query parameter Gemini's API reads a key from when no `x-goog-api-key` header is sent.
const GEMINI_KEY_PARAMETER: &str = "key";

/// Serves one proxied request. Never fails: errors become OpenAI-shaped JSON responses.
pub async fn handle(
    app: Arc<App>,
    request: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let mut overhead = Overhead::started_at(started);
    let in_flight = InFlight::start(app.metrics.clone());
    let method = request.method().clone();

    let resolved = app.upstream.resolve(request.uri());
    let dialect = match (&resolved, request.method()) {
        (Ok(r), &Method::POST) => DialectKind::from_path(&r.api_path),
        _ => None,
    };
    let route = route_label(dialect);
    // Taken before the request moves on, and only when they are logged.
    let access = app.config.server.access_log.then(|| {
        (
            request.uri().path().to_string(),
            resolved
                .as_ref()
                .map_or_else(|_| "-".to_string(), |r| r.base_url.clone()),
        )
    });

    let result = match resolved {
        Ok(resolved) => forward(&app, request, resolved, dialect, peer, &mut overhead).await,
        Err(e) => Err(e),
    };
    let response = result.unwrap_or_else(|e| {
        tracing::warn!(route, status = e.status().as_u16(), error = %e, "request failed");
        e.to_response::<Full<Bytes>>()
            .map(|b| b.map_err(|never| match never {}).boxed_unsync())
    });

    let status = response.status().as_u16();
    // A refusal for length streamed inside a 200 counts as the refusal it is, as a 400 would.
    let counted = match response.extensions().get::<StreamedRefusal>() {
        Some(_) => 400,
        None => status,
    };
    app.metrics.request_finished(
        dialect,
        &method,
        counted,
        started.elapsed(),
        overhead.finish(),
    );
    tracing::debug!(
        route,
        method = method_label(&method),
        status,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "proxied"
    );
    if let Some((path, upstream)) = access {
        log_access(&method, &path, &upstream, &response, started.elapsed());
    }

    // Counted in flight until the answer has been sent, and watched for a cut mid-body.
    let session = response.headers().get(HEADER_SESSION).cloned();
    response.map(|body| {
        Answer {
            inner: body,
            in_flight,
            route,
            session,
        }
        .boxed_unsync()
    })
}

/// A response body on its way to the client: keeps the request counted in flight until it has
/// been sent or dropped, and counts and logs an upstream that breaks the body off (the status
/// was already sent as a success, so nothing else would show it).
struct Answer {
    inner: ProxyBody,
    in_flight: InFlight,
    route: &'static str,
    /// `x-compactor-session`, for the log.
    session: Option<HeaderValue>,
}

impl Body for Answer {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Err(e))) = &polled {
            this.in_flight
                .0
                .upstream_error(UpstreamErrorKind::StreamCut);
            let session = this.session.as_ref().and_then(|v| v.to_str().ok());
            tracing::warn!(route = this.route, session, error = %e, "upstream response cut off mid-body");
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

async fn forward(
    app: &Arc<App>,
    request: Request<Incoming>,
    resolved: Resolved,
    dialect: Option<DialectKind>,
    peer: SocketAddr,
    overhead: &mut Overhead,
) -> Result<Response<ProxyBody>, Error> {
    if tunnel::wants_tunnel(&request) {
        let mut upstream =
            Request::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
        // An HTTP/2 WebSocket (extended CONNECT) goes on as the HTTP/1.1 GET upgrade.
        *upstream.method_mut() = match request.method() {
            &Method::CONNECT => Method::GET,
            other => other.clone(),
        };
        *upstream.uri_mut() = resolved.uri.clone();
        *upstream.headers_mut() = request.headers().clone();
        upstream.headers_mut().remove(HEADER_MODE);
        prepare_headers(upstream.headers_mut(), &resolved.host, peer.ip());
        return tunnel::forward(app, request, upstream, overhead).await;
    }
    let (mut parts, body) = request.into_parts();
    // A value that names no mode is ignored (the request goes by the configuration).
    let mode = parts
        .headers
        .remove(HEADER_MODE)
        .and_then(|v| v.to_str().ok().and_then(Mode::from_header));
    prepare_headers(&mut parts.headers, &resolved.host, peer.ip());
    parts.uri = resolved.uri.clone();

    // Headers for the client's response: set for every chat call, empty otherwise.
    let mut chat_headers = HeaderMap::new();
    let mut estimate = None;
    let mut retry = None;
    // The session the store recorded for this request, told how the provider answers it.
    let mut recorded = None;
    let body = match dialect {
        Some(dialect) if app.pipeline_for(resolved.route).enabled() => 'chat: {
            let read = client_body::read(
                body,
                &parts.headers,
                app.config.server.max_body_bytes,
                app.config.client_timeout(),
                &app.buffers,
                &app.bodies,
            )
            .await?;
            let (original, held) = match read {
                client_body::Read::Whole(original, held) => (original, held),
                client_body::Read::OverBudget(streaming) => {
                    app.metrics.unbuffered_request();
                    chat_headers.insert(HEADER_COMPACTED, HeaderValue::from_static("false"));
                    break 'chat streaming.into_body(app.config.client_timeout());
                }
            };
            let caller = Arc::new(caller(
                &parts.headers,
                parts.uri.query(),
                &resolved,
                dialect,
            ));
            let session_header = parts
                .headers
                .get(app.config.session.header.as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            // The seed's bound on summarizer calls holds per client request: a compaction after
            // a refusal for length gets what this one leaves.
            let attempts = Attempts::per_request();
            let context = RequestContext {
                caller: &caller,
                session_header: session_header.as_deref(),
                long_context: long_context(&parts.headers),
                attempts: &attempts,
                mode,
            };
            let mut processed = app
                .pipeline_for(resolved.route)
                .handle(dialect, &original, &context)
                .await;
            let cohort = processed.cohort;
            overhead.exclude(processed.summarizer_time);
            estimate = processed.estimate.take();
            recorded = processed
                .session_id
                .clone()
                .map(|id| (processed.tenant, id));
            let forwarded_tokens = estimate.as_ref().map_or(0, |e| e.tokens);
            let forwarded = annotate(
                &mut chat_headers,
                processed,
                estimate.as_ref(),
                original.clone(),
            );
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(forwarded.len()));
            retry = Some(Retry {
                dialect,
                original,
                _held: held,
                caller,
                session_header,
                attempts,
                cohort,
                route: resolved.route,
                forwarded_tokens,
                method: parts.method.clone(),
                uri: parts.uri.clone(),
                headers: parts.headers.clone(),
            });
            Full::new(forwarded)
                .map_err(|never| match never {})
                .boxed_unsync()
        }
        Some(_) => {
            chat_headers.insert(HEADER_COMPACTED, HeaderValue::from_static("false"));
            client_body::streamed(body, app.config.client_timeout())
        }
        None => client_body::streamed(body, app.config.client_timeout()),
    };

    let sent = Instant::now();
    let response = send(app, Request::from_parts(parts, body), overhead).await?;
    app.metrics.upstream_answered(sent.elapsed());
    let response = match retry {
        Some(retry) => {
            let session = chat_headers.get(HEADER_SESSION).cloned();
            let session = session.as_ref().and_then(|v| v.to_str().ok());
            let retried = retry_after_refusal(app, response, retry, session, overhead).await?;
            if retried.again {
                chat_headers.insert(HEADER_RETRIED, HeaderValue::from_static("true"));
                chat_headers.insert(HEADER_COMPACTED, HeaderValue::from_static("true"));
                // The usage of the retried request is not the estimate's to compare with.
                estimate = None;
            }
            let mut response = retried.response;
            if retried.streamed_refusal {
                response.extensions_mut().insert(StreamedRefusal);
            }
            response
        }
        None => response.map(|b| b.map_err(BoxError::from).boxed_unsync()),
    };

    if let Some((tenant, id)) = &recorded {
        settle_session(app, *tenant, id, response.status()).await;
    }

    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.extend(chat_headers);
    // Successful chat responses are watched for the provider's `usage` as they stream by.
    let scan = match &estimate {
        Some(_) if parts.status.is_success() => {
            Format::from_headers(&parts.headers).zip(Encoding::from_headers(&parts.headers))
        }
        _ => None,
    };
    let body = match (estimate, scan) {
        (Some(estimate), Some((format, encoding))) => {
            let app = app.clone();
            let record: usage::OnUsage = Box::new(move |usage| {
                if let Some(usage) = &usage {
                    learn_from_usage(&app, &estimate, usage);
                    bill(&app, &estimate, usage, recorded.as_ref());
                    usage::record(
                        &app.metrics,
                        app.pipeline.calibration(),
                        estimate.model.as_deref(),
                        Some(estimate.tokens as u64),
                        usage,
                    );
                }
            });
            Observed::new(body, Some(format), record)
                .encoded(encoding)
                .boxed_unsync()
        }
        _ => body,
    };
    Ok(Response::from_parts(parts, body))
}

/// Counts what the provider billed for a response, when its model has a price (under the
/// name its window is looked up by: a long-context request is priced as such, or not at all),
/// and what the request as received would have cost; adds both to the session's totals (a
/// store that waits on the network does it off the response path).
fn bill(
    app: &Arc<App>,
    estimate: &ForwardedEstimate,
    usage: &Usage,
    session: Option<&(TenantId, String)>,
) {
    let Some(price) = estimate.price else {
        return;
    };
    let billed = crate::cost::Bill::of(usage, &price);
    app.metrics.cost(estimate.dialect, billed.by_kind());
    app.metrics.cohort_cost(estimate.cohort, billed.total());
    let mut cost = SessionCost {
        usd: billed.total(),
        input_tokens: usage.input,
        cache_read_tokens: usage.cache_read,
        ..SessionCost::default()
    };
    // Without compactor: the request as received, unless the provider would have refused it.
    if estimate.received > estimate.context_window {
        app.metrics.over_window_without_compactor(estimate.dialect);
        cost.over_window_without_compactor = 1;
    } else {
        // The model's billed ÷ estimated ratio, once one was learned.
        let calibration = estimate.model.as_deref().and_then(|m| {
            let c = app.pipeline.calibration();
            (c.samples(m) > 0).then(|| c.factor(m))
        });
        let without = crate::cost::without_compactor(
            &price,
            estimate.dialect == DialectKind::Messages,
            (estimate.received, estimate.received_cached),
            estimate.tokens,
            usage,
            calibration,
        );
        app.metrics
            .cost_without_compactor(estimate.dialect, without.total());
        cost.without_compactor_usd = without.total();
    }
    let (Some((tenant, id)), Ok(runtime)) = (session, tokio::runtime::Handle::try_current()) else {
        return;
    };
    let (app, tenant, id) = (app.clone(), *tenant, id.clone());
    let mut recording = Box::pin(async move {
        let store = app.pipeline.store();
        if let Err(e) = store.record_cost(tenant, &id, cost).await {
            tracing::debug!(error = %e, "session cost not recorded");
        }
    });
    // The memory store records at once: a task only for a store that waits on the network
    // (Redis). A task per request was a wake of a parked worker thread per request (a system
    // call and a context switch on the other core) to add two numbers.
    if (&mut recording).now_or_never().is_none() {
        runtime.spawn(recording);
    }
}

/// A successful request whose `usage` (input plus output) is more than the window it was
/// checked against proves the model's window is at least that: learned, off the response
/// path. Rare (a window the table has too small), so the check comes first.
fn learn_from_usage(app: &Arc<App>, estimate: &ForwardedEstimate, usage: &Usage) {
    let used = usage.input.saturating_add(usage.output);
    if used <= estimate.context_window as u64 {
        return;
    }
    let Some(model) = estimate.model.clone() else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let app = app.clone();
    let caller = estimate.caller.clone();
    let long_context = estimate.long_context;
    let used = usize::try_from(used).unwrap_or(usize::MAX);
    runtime.spawn(async move {
        let model = window_model(&model, long_context);
        app.pipeline
            .learn_window(&caller.upstream_base_url, &model, used, WindowSource::Usage)
            .await;
    });
}

/// Tells the store how the provider answered the request of session `(tenant, id)`: a
/// success confirms the tenant, 401/403 takes back what the request recorded
/// ([`ProviderAnswer`]); any other answer says nothing about the credential.
async fn settle_session(app: &App, tenant: TenantId, id: &str, status: http::StatusCode) {
    let answer = match status.as_u16() {
        200..=299 => ProviderAnswer::Accepted,
        401 | 403 => ProviderAnswer::Unauthorised,
        _ => return,
    };
    let store = app.pipeline.store();
    if let Err(e) = store.provider_answered(tenant, id, answer).await {
        tracing::warn!(error = %e, "session store unavailable; continuing without it");
    }
}

/// Whether the request enables its model's long context window (Anthropic's `context-1m` beta
/// flag in any `anthropic-beta` header).
fn long_context(headers: &HeaderMap) -> bool {
    headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(enables_long_context)
}

/// Sends a request upstream, counting a failure by its kind.
async fn send(
    app: &App,
    request: Request<ProxyBody>,
    overhead: &mut Overhead,
) -> Result<Response<Incoming>, Error> {
    // A reference count, not a copy: the name is written only if the exchange fails.
    let uri = request.uri().clone();
    counted(app, overhead.wait(app.upstream.send(request)).await, &uri)
}

/// An upstream's answer, its failure counted by kind and naming the upstream of `uri`.
fn counted(
    app: &App,
    answer: Result<Response<Incoming>, SendError>,
    uri: &http::Uri,
) -> Result<Response<Incoming>, Error> {
    answer.map_err(|e| {
        if let Some(kind) = e.kind() {
            app.metrics.upstream_error(kind);
        }
        match Error::from(e) {
            Error::UpstreamUnavailable { cause, .. } => Error::UpstreamUnavailable {
                upstream: origin(uri),
                cause,
            },
            other => other,
        }
    })
}

/// What a chat request keeps to be sent again if the provider refuses it for its length.
struct Retry {
    dialect: DialectKind,
    original: Bytes,
    /// The original's share of `server.max_buffered_bytes`, held as long as it is.
    _held: crate::budget::Held,
    caller: Arc<Caller>,
    session_header: Option<String>,
    /// The summarizer calls the request may still make.
    attempts: Attempts,
    /// The request's cohort: only a compacted one is compacted again after a refusal.
    cohort: Cohort,
    /// Its `[[routes]]` entry ([`Resolved::route`]): compacted again by that route's pipeline.
    route: Option<usize>,
    /// Estimated tokens of the body that was sent.
    forwarded_tokens: usize,
    method: http::Method,
    uri: http::Uri,
    headers: HeaderMap,
}

/// The most of an error body read to recognise a refusal for length; a longer body passes
/// through (what was read first included).
const REFUSAL_BODY_LIMIT: u64 = 64 * 1024;

/// Whether a response may be a refusal for length: a status providers use for it, and no
/// declared body too long to be one.
fn maybe_refusal(response: &Response<Incoming>) -> bool {
    let status = response.status().as_u16();
    let too_long = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > REFUSAL_BODY_LIMIT);
    matches!(status, 400 | 413 | 422 | 500) && !too_long
}

/// An error body read to recognise a refusal: whole, or its first bytes (more than a refusal
/// would hold) with the rest still to come.
enum ErrorBody {
    Whole(Bytes),
    Partial(Bytes, Incoming),
}

/// Reads an error body for at most `within` (the upstream response timeout: a refusal comes
/// whole right after its head). One that takes longer is no refusal compactor can wait for:
/// the client gets the head at once and the body as it comes, so a provider stalling mid-body
/// cannot hold back a status the client would have seen without compactor.
async fn read_error_body(mut body: Incoming, within: Duration) -> Result<ErrorBody, hyper::Error> {
    let deadline = tokio::time::Instant::now() + within;
    let mut read = Vec::new();
    loop {
        // Cancel-safe: a frame not yet taken stays in `body`.
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(frame)) => frame?,
            Ok(None) => return Ok(ErrorBody::Whole(Bytes::from(read))),
            Err(_) => return Ok(ErrorBody::Partial(Bytes::from(read), body)),
        };
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
        }
        if read.len() as u64 > REFUSAL_BODY_LIMIT {
            return Ok(ErrorBody::Partial(Bytes::from(read), body));
        }
    }
}

/// A body whose first bytes were already read: they come first, then the rest as it arrives.
struct Prefixed {
    prefix: Option<Bytes>,
    rest: Incoming,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}

/// The response the client gets after a possible refusal, whether it answers a second,
/// compacted request, and whether it is a refusal for length inside a `200` stream.
struct Retried {
    response: Response<ProxyBody>,
    again: bool,
    streamed_refusal: bool,
}

/// Marks (in its extensions) a `200` response whose stream is a refusal for length, for the
/// request metrics to count as one.
#[derive(Clone, Copy)]
struct StreamedRefusal;

/// A refusal for length and how it came.
struct Refusal {
    overflow: Overflow,
    via: RefusalVia,
}

/// Reads the start of the provider's answer to a chat request that could be sent again, as
/// far as telling whether it is a refusal for length: a small error response (see
/// [`read_refusal`]), or a `200` event stream held until its first content event
/// ([`stream_hold`]). Every other answer passes on at once. The response to pass on comes back
/// whole in every case: what was read first, then the rest as it comes.
async fn read_answer(
    app: &App,
    response: Response<Incoming>,
    dialect: DialectKind,
    overhead: &mut Overhead,
) -> Result<(Response<ProxyBody>, Option<Refusal>), Error> {
    if maybe_refusal(&response) {
        let (passed, refusal) = read_refusal(app, response).await?;
        let refusal = refusal.map(|overflow| Refusal {
            overflow,
            via: RefusalVia::Status,
        });
        return Ok((passed, refusal));
    }
    if !held_stream(&response) {
        return Ok((
            response.map(|b| b.map_err(BoxError::from).boxed_unsync()),
            None,
        ));
    }
    let (parts, body) = response.into_parts();
    let held = stream_hold::hold(body, dialect, app.config.response_timeout(), overhead).await;
    let (body, refusal) = match held {
        stream_hold::Held::Pass(body) => (body, None),
        stream_hold::Held::Refused(body, overflow) => (
            body,
            Some(Refusal {
                overflow,
                via: RefusalVia::Stream,
            }),
        ),
    };
    let body = body.map_err(BoxError::from).boxed_unsync();
    Ok((Response::from_parts(parts, body), refusal))
}

/// Whether a response is one [`stream_hold`] can read: a success streamed as server-sent
/// events, not compressed.
fn held_stream(response: &Response<Incoming>) -> bool {
    response.status().is_success()
        && Format::from_headers(response.headers()) == Some(Format::Sse)
        && Encoding::from_headers(response.headers()) == Some(Encoding::Identity)
}

/// Reads the start of the provider's answer ([`read_answer`]); when it is a refusal for
/// length, compacts the request and sends it once more. Whatever cannot be retried goes to
/// the client exactly as the provider sent it.
async fn retry_after_refusal(
    app: &App,
    response: Response<Incoming>,
    retry: Retry,
    session: Option<&str>,
    overhead: &mut Overhead,
) -> Result<Retried, Error> {
    let (passed, refusal) = read_answer(app, response, retry.dialect, overhead).await?;
    let Some(Refusal { overflow, via }) = refusal else {
        return Ok(Retried {
            response: passed,
            again: false,
            streamed_refusal: false,
        });
    };
    app.metrics.cohort_context_error(retry.cohort);
    if !retry.cohort.compacts() {
        // Shadow, control and opted-out requests reach the agent as without compactor.
        return Ok(Retried {
            response: passed,
            again: false,
            streamed_refusal: via == RefusalVia::Stream,
        });
    }
    if via == RefusalVia::Stream {
        tracing::info!(
            route = retry.dialect.label(),
            session,
            window = overflow.window,
            requested = overflow.requested,
            "the provider refused the request for its length inside a 200 stream; held back from the client"
        );
    }
    let context = RequestContext {
        caller: &retry.caller,
        session_header: retry.session_header.as_deref(),
        long_context: long_context(&retry.headers),
        attempts: &retry.attempts,
        mode: Some(Mode::Enforce),
    };
    let started = Instant::now();
    let compacted = app
        .pipeline_for(retry.route)
        .compact_after_refusal(
            retry.dialect,
            &retry.original,
            &context,
            overflow,
            retry.forwarded_tokens,
        )
        .await;
    overhead.exclude(started.elapsed());
    app.metrics.overflow_retry(compacted.is_some(), via);
    let Some(smaller) = compacted else {
        return Ok(Retried {
            response: passed,
            again: false,
            streamed_refusal: via == RefusalVia::Stream,
        });
    };
    let mut request = Request::new(
        Full::new(smaller.body.clone())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *request.method_mut() = retry.method;
    *request.uri_mut() = retry.uri;
    *request.headers_mut() = retry.headers;
    request.headers_mut().insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(smaller.body.len()),
    );
    let response = send(app, request, overhead).await?;
    // The provider says whether the smaller request worked: refused for its length again (with
    // an error status or inside a stream), it is a failure of the conversation's breaker.
    let (response, refused_again) = read_answer(app, response, retry.dialect, overhead).await?;
    app.pipeline
        .retry_answered(&smaller, refused_again.is_some())
        .await;
    Ok(Retried {
        response,
        again: true,
        streamed_refusal: refused_again.is_some_and(|r| r.via == RefusalVia::Stream),
    })
}

/// Reads an error response as far as telling whether it is a refusal for length: the response
/// to pass on (its body whole, or the bytes read first and then the rest as it comes when it
/// is longer or slower than any refusal) and the refusal, if it is one.
async fn read_refusal(
    app: &App,
    response: Response<Incoming>,
) -> Result<(Response<ProxyBody>, Option<Overflow>), Error> {
    let (parts, body) = response.into_parts();
    let bytes = match read_error_body(body, app.config.response_timeout()).await {
        Ok(ErrorBody::Whole(bytes)) => bytes,
        Ok(ErrorBody::Partial(prefix, rest)) => {
            let body = Prefixed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            };
            let body = body.map_err(BoxError::from).boxed_unsync();
            return Ok((Response::from_parts(parts, body), None));
        }
        Err(e) => {
            return Err(Error::UpstreamUnavailable {
                upstream: None,
                cause: e.to_string(),
            })
        }
    };
    let refusal = crate::overflow::recognise(parts.status.as_u16(), &bytes);
    let body = Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync();
    Ok((Response::from_parts(parts, body), refusal))
}

/// The access log line of one request (`server.access_log`), from what its response head
/// says (the `x-compactor-*` headers a chat request gets; `-` where there are none).
fn log_access(
    method: &Method,
    path: &str,
    upstream: &str,
    response: &Response<ProxyBody>,
    elapsed: Duration,
) {
    let header = |name: &HeaderName| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
    };
    tracing::info!(
        target: "compactor::access",
        method = method.as_str(),
        path,
        status = response.status().as_u16(),
        upstream,
        session = header(&HEADER_SESSION),
        tokens_in = header(&HEADER_TOKENS_BEFORE),
        tokens_out = header(&HEADER_TOKENS_AFTER),
        compacted = header(&HEADER_COMPACTED),
        duration_ms = elapsed.as_secs_f64() * 1e3,
        "request"
    );
}

/// Fills the `x-compactor-*` response headers from the compaction outcome and the estimate
/// of the request as forwarded, and returns the body to forward.
fn annotate(
    headers: &mut HeaderMap,
    processed: Processed,
    estimate: Option<&ForwardedEstimate>,
    original: Bytes,
) -> Bytes {
    if let Some(v) = processed
        .session_id
        .and_then(|id| HeaderValue::from_str(&id).ok())
    {
        headers.insert(HEADER_SESSION, v);
    }
    let (body, result, masked) = match processed.outcome {
        Outcome::Rewritten { body, result, .. } | Outcome::Reused { body, result } => {
            (body, Some(result), None)
        }
        Outcome::Masked {
            body,
            pre_tokens,
            post_tokens,
            ..
        } => (body, None, Some((pre_tokens, post_tokens))),
        Outcome::Unchanged | Outcome::Failed => (original, None, None),
    };
    let compacted = HeaderValue::from_static(if result.is_some() { "true" } else { "false" });
    headers.insert(HEADER_COMPACTED, compacted);
    if let Some((before, after)) = masked {
        headers.insert(HEADER_TOKENS_BEFORE, HeaderValue::from(before));
        headers.insert(HEADER_TOKENS_AFTER, HeaderValue::from(after));
        return body;
    }
    match (result, estimate) {
        (Some(r), _) => {
            headers.insert(HEADER_TOKENS_BEFORE, HeaderValue::from(r.pre_tokens));
            headers.insert(HEADER_TOKENS_AFTER, HeaderValue::from(r.post_tokens));
            headers.insert(HEADER_COMPACTION_NUM, HeaderValue::from(r.compaction_num));
        }
        // Forwarded as received: both estimates are the same.
        (None, Some(estimate)) => {
            headers.insert(HEADER_TOKENS_BEFORE, HeaderValue::from(estimate.tokens));
            headers.insert(HEADER_TOKENS_AFTER, HeaderValue::from(estimate.tokens));
        }
        (None, None) => {}
    }
    body
}

/// What a summarizer needs to call the caller's own provider.
fn caller(
    headers: &HeaderMap,
    query: Option<&str>,
    resolved: &Resolved,
    dialect: DialectKind,
) -> Caller {
    let mut credentials: Vec<(String, String)> = CREDENTIAL_HEADERS
        .iter()
        .filter_map(|name| {
            let value = headers.get(name)?.to_str().ok()?;
            Some((name.as_str().to_string(), value.to_string()))
        })
        .collect();
    // Only Gemini reads a key from the query, and only when no header carries one.
    let header_key = credentials.iter().any(|(n, _)| n == "x-goog-api-key");
    if dialect == DialectKind::Gemini && !header_key {
        let key_in_query = query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .find_map(|pair| pair.strip_prefix(GEMINI_KEY_PARAMETER)?.strip_prefix('='));
        if let Some(key) = key_in_query.filter(|k| !k.is_empty()) {
            credentials.push(("x-goog-api-key".into(), key.to_string()));
        }
    }
    Caller {
        upstream_base_url: resolved.base_url.clone(),
        api_prefix: dialect.api_prefix(&resolved.api_path).to_string(),
        credentials,
        api: dialect.api(),
    }
}

/// Holds `compactor_in_flight_requests` up for as long as it lives; decrements exactly once.
struct InFlight(Arc<Metrics>);

impl InFlight {
    fn start(metrics: Arc<Metrics>) -> InFlight {
        metrics.request_started();
        InFlight(metrics)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}
