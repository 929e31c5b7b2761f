//! Usage: the provider's real token counts, read from response bodies on their way through.
//!
//! [`Observed`] wraps a response body and hands every frame on the moment it arrives, the very
//! same frame, while a scanner looks at its bytes for the provider's `usage` object. Nothing
//! is buffered beyond a bounded scan window, so memory stays bounded whatever the body size:
//!
//! - JSON bodies (Chat Completions, Responses and Anthropic Messages without streaming): an
//!   incremental tokenizer tracks nesting and strings and captures only the value of the
//!   top-level `usage` key (at most [`JSON_CAPTURE_LIMIT`] bytes), wherever it sits.
//! - SSE streams: only the current incomplete line (at most [`SSE_LINE_LIMIT`] bytes; a longer
//!   line is skipped) and the current event's `data` are kept. Events whose data mention
//!   `"usage"` are parsed: Chat Completions' final chunk (`stream_options.include_usage`),
//!   Anthropic's `message_start` (`message.usage`) and `message_delta` (`usage`), and
//!   Responses' `response.completed` (`response.usage`), and Gemini's `usageMetadata` (every
//!   chunk of a `streamGenerateContent?alt=sse` stream, and the top level of a
//!   `generateContent` answer). Later values override earlier ones field by field
//!   (Anthropic's `message_delta` carries the final `output_tokens`).
//!
//! Counts are normalised to [`Usage`] so that `input` is comparable to compactor's estimate of
//! the whole forwarded prompt:
//!
//! - OpenAI (`prompt_tokens`, or `input_tokens` with `input_tokens_details`): the input count
//!   already includes cached tokens; `input` is that count and `cache_read` the
//!   `cached_tokens` detail. OpenAI reports no cache writes.
//! - Anthropic (`input_tokens` with `cache_read_input_tokens` / `cache_creation_input_tokens`):
//!   `input_tokens` excludes both cache counts, so `input` is the sum of all three;
//!   `cache_read` and `cache_write` are the two cache counts.
//! - Gemini (`promptTokenCount`, `candidatesTokenCount`, `thoughtsTokenCount`,
//!   `cachedContentTokenCount`): the prompt count includes cached tokens, so `input` is it and
//!   `cache_read` the cached count; `output` is the candidates' tokens plus the thoughts'
//!   (billed as output). Gemini reports no cache writes.
//!
//! When the body ends, fails or is dropped (the client went away), the completion callback
//! runs exactly once with what was found (`None` when no usage was seen, e.g. non-JSON bodies
//! or an encoding other than gzip and deflate, whose decompressed copy the scanner reads).
//! [`record`] feeds the metrics and the per-model [`Calibration`].

use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::HeaderMap;
use hyper::body::{Body, Frame, SizeHint};
use memchr::memmem::Finder;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::calibration::Calibration;
pub use crate::dialect::answer::Usage;
use crate::dialect::answer::UsageFields;
use crate::metrics::{Metrics, UsageKind};

/// Most bytes of a JSON body's top-level `usage` value kept for parsing.
pub const JSON_CAPTURE_LIMIT: usize = 64 * 1024;

/// Bytes reserved for a JSON body's `usage` value when it starts (it grows past them if
/// need be, up to [`JSON_CAPTURE_LIMIT`]).
const USAGE_CAPACITY: usize = 512;

/// Longest SSE line (and event data) kept; longer ones are skipped.
pub const SSE_LINE_LIMIT: usize = 1024 * 1024;

/// How far a compressed body may expand while it is scanned: this many times the compressed
/// bytes received so far, past [`EXPANSION_FLOOR`]. Text and JSON compress a few to a few
/// dozen times; a body expanding further (a compression bomb from a misbehaving upstream)
/// would cost decompression time on a worker out of all proportion to what it sends, so its
/// usage is given up (the body itself passes through untouched).
const EXPANSION_LIMIT: usize = 100;

/// Decompressed bytes any compressed body may expand to, whatever its ratio.
const EXPANSION_FLOOR: usize = 8 * 1024 * 1024;

/// Capacity above which an emptied SSE buffer is released rather than kept for reuse.
const KEEP_CAPACITY: usize = 64 * 1024;

impl From<&compactor_plugin_api::SummaryUsage> for Usage {
    /// What a summarizer's backend reported its model billed for a summary.
    fn from(u: &compactor_plugin_api::SummaryUsage) -> Usage {
        Usage {
            input: u.input,
            output: u.output,
            cache_read: u.cache_read,
            cache_write: u.cache_write,
        }
    }
}

/// How a response body is scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON document (`application/json`, `…+json`).
    Json,
    /// Server-sent events (`text/event-stream`).
    Sse,
}

/// How a response body is compressed (`Content-Encoding`). SDKs ask for gzip, so providers
/// often compress JSON bodies; the scanner reads a decompressed copy while the compressed
/// frames pass through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Not compressed.
    Identity,
    /// `gzip`.
    Gzip,
    /// `deflate` (zlib-wrapped, as HTTP means it).
    Deflate,
}

impl Encoding {
    /// The body's encoding; `None` when it cannot be decoded here (`br`, `zstd`, stacked
    /// encodings).
    pub fn from_headers(headers: &HeaderMap) -> Option<Encoding> {
        let mut values = headers.get_all(CONTENT_ENCODING).iter();
        let Some(value) = values.next() else {
            return Some(Encoding::Identity);
        };
        if values.next().is_some() {
            return None;
        }
        let value = value.to_str().ok()?.trim();
        let is = |name: &str| value.eq_ignore_ascii_case(name);
        if value.is_empty() || is("identity") {
            Some(Encoding::Identity)
        } else if is("gzip") || is("x-gzip") {
            Some(Encoding::Gzip)
        } else if is("deflate") {
            Some(Encoding::Deflate)
        } else {
            None
        }
    }
}

impl Format {
    /// The format of a response from its `Content-Type`; `None` when the body is neither JSON
    /// nor SSE. (Whether it can be decoded is [`Encoding::from_headers`]'s question.)
    pub fn from_headers(headers: &HeaderMap) -> Option<Format> {
        let content_type = headers.get(CONTENT_TYPE)?.to_str().ok()?;
        let essence = content_type.split(';').next().unwrap_or_default().trim();
        let json_suffix = essence
            .len()
            .checked_sub(5)
            .and_then(|at| essence.get(at..))
            .is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"));
        if essence.eq_ignore_ascii_case("text/event-stream") {
            Some(Format::Sse)
        } else if essence.eq_ignore_ascii_case("application/json") || json_suffix {
            Some(Format::Json)
        } else {
            None
        }
    }
}

/// The completion callback of an [`Observed`] body.
pub type OnUsage = Box<dyn FnOnce(Option<Usage>) + Send>;

/// A response body passed through frame by frame while its `usage` is observed.
pub struct Observed<B> {
    inner: B,
    scanner: Option<Feed>,
    on_done: Option<OnUsage>,
}

impl<B> Observed<B> {
    /// Wraps `inner`. `format` `None` scans nothing (the callback then gets `None`);
    /// `on_done` runs exactly once, when the body ends, fails or is dropped.
    pub fn new(inner: B, format: Option<Format>, on_done: OnUsage) -> Observed<B> {
        Observed {
            inner,
            scanner: format.map(|f| Feed::Plain(Box::new(Scanner::new(f)))),
            on_done: Some(on_done),
        }
    }

    /// Scans a decompressed copy of a body sent with this `Content-Encoding`.
    pub fn encoded(mut self, encoding: Encoding) -> Observed<B> {
        self.scanner = match (self.scanner.take(), encoding) {
            (Some(Feed::Plain(s)), Encoding::Gzip) => Some(Feed::Gzip(Box::new(
                flate2::write::GzDecoder::new(Sink::new(*s)),
            ))),
            (Some(Feed::Plain(s)), Encoding::Deflate) => Some(Feed::Deflate(Box::new(
                flate2::write::ZlibDecoder::new(Sink::new(*s)),
            ))),
            (other, _) => other,
        };
        self
    }

    fn complete(&mut self) {
        if let Some(on_done) = self.on_done.take() {
            let usage = self.scanner.take().and_then(Feed::finish);
            on_done(usage);
        }
    }
}

/// The scanner, fed directly or through a decompressor (each boxed: a scanner holds every
/// usage field of four APIs, the decoders their windows).
enum Feed {
    Plain(Box<Scanner>),
    Gzip(Box<flate2::write::GzDecoder<Sink>>),
    Deflate(Box<flate2::write::ZlibDecoder<Sink>>),
}

impl Feed {
    /// Feeds a chunk; `false` when the compressed stream is corrupt or expands past
    /// [`EXPANSION_LIMIT`] (scanning stops).
    fn feed(&mut self, chunk: &[u8]) -> bool {
        use std::io::Write;
        match self {
            Feed::Plain(s) => {
                s.feed(chunk);
                true
            }
            Feed::Gzip(d) => {
                d.get_mut().received(chunk.len());
                d.write_all(chunk).is_ok()
            }
            Feed::Deflate(d) => {
                d.get_mut().received(chunk.len());
                d.write_all(chunk).is_ok()
            }
        }
    }

    fn finish(self) -> Option<Usage> {
        let scanner = match self {
            Feed::Plain(s) => Some(*s),
            Feed::Gzip(mut d) => {
                let _ = d.try_finish();
                d.get_mut().scanner.take()
            }
            Feed::Deflate(mut d) => {
                let _ = d.try_finish();
                d.get_mut().scanner.take()
            }
        };
        scanner.and_then(Scanner::finish)
    }
}

/// Where a decompressor writes: straight into the scanner (memory stays bounded by the
/// scanner's own limits and the decompressor's window), up to the expansion allowed.
struct Sink {
    scanner: Option<Scanner>,
    /// Compressed bytes received so far.
    received: usize,
    /// Decompressed bytes written so far.
    written: usize,
}

impl Sink {
    fn new(scanner: Scanner) -> Sink {
        Sink {
            scanner: Some(scanner),
            received: 0,
            written: 0,
        }
    }

    /// `compressed` more bytes of the body arrived.
    fn received(&mut self, compressed: usize) {
        self.received = self.received.saturating_add(compressed);
    }
}

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.written = self.written.saturating_add(buf.len());
        let allowed = EXPANSION_FLOOR.saturating_add(self.received.saturating_mul(EXPANSION_LIMIT));
        if self.written > allowed {
            // The decompressor stops at this error, and the feed with it.
            self.scanner = None;
            return Err(std::io::Error::other("compressed body expands too far"));
        }
        if let Some(s) = self.scanner.as_mut() {
            s.feed(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Observed<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(scanner)) = (frame.data_ref(), this.scanner.as_mut()) {
                    if !scanner.feed(data) {
                        this.scanner = None;
                    }
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => this.complete(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for Observed<B> {
    fn drop(&mut self) {
        self.complete();
    }
}

/// Records a response's usage: counts it in `compactor_upstream_usage_tokens_total` and,
/// given the raw (uncalibrated) estimate of the forwarded request's input tokens, records
/// `compactor_estimate_error_ratio` and feeds the model's calibration. The proxy calls it from
/// an [`Observed`] body's completion callback.
pub fn record(
    metrics: &Metrics,
    calibration: &Calibration,
    model: Option<&str>,
    estimated_input: Option<u64>,
    usage: &Usage,
) {
    for (kind, n) in [
        (UsageKind::Input, usage.input),
        (UsageKind::Output, usage.output),
        (UsageKind::CacheRead, usage.cache_read),
        (UsageKind::CacheWrite, usage.cache_write),
    ] {
        metrics.upstream_usage(kind, n);
    }
    let Some(estimated) = estimated_input else {
        return;
    };
    if usage.input == 0 {
        return;
    }
    let actual = usage.input as f64;
    metrics.estimate_error((estimated as f64 - actual) / actual);
    if let Some(model) = model {
        calibration.observe(model, estimated, usage.input);
    }
}

/// A scanner for one body.
#[derive(Debug)]
enum Scanner {
    Json(JsonScan),
    Sse(SseScan),
}

impl Scanner {
    fn new(format: Format) -> Scanner {
        match format {
            Format::Json => Scanner::Json(JsonScan::default()),
            Format::Sse => Scanner::Sse(SseScan::default()),
        }
    }

    fn feed(&mut self, chunk: &[u8]) {
        match self {
            Scanner::Json(s) => s.feed(chunk),
            Scanner::Sse(s) => s.feed(chunk),
        }
    }

    fn finish(self) -> Option<Usage> {
        match self {
            Scanner::Json(s) => s.fields.usage(),
            Scanner::Sse(mut s) => {
                s.finish();
                s.fields.usage()
            }
        }
    }

    /// Bytes held in scan buffers (for the memory-bound tests).
    #[cfg(test)]
    fn retained(&self) -> usize {
        match self {
            Scanner::Json(s) => s.capture.capacity(),
            Scanner::Sse(s) => s.line.capacity() + s.data.capacity(),
        }
    }
}

/// A `usage` object as any of the four APIs writes it (Gemini's `usageMetadata` too).
#[derive(Debug, Default, Deserialize)]
struct RawUsage {
    #[serde(rename = "promptTokenCount")]
    prompt_token_count: Option<u64>,
    #[serde(rename = "candidatesTokenCount")]
    candidates_token_count: Option<u64>,
    #[serde(rename = "thoughtsTokenCount")]
    thoughts_token_count: Option<u64>,
    #[serde(rename = "cachedContentTokenCount")]
    cached_content_token_count: Option<u64>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// An SSE event's data, as far as usage goes. Sub-objects are kept raw and parsed leniently,
/// so an unrelated field of an unexpected shape (a string `message`) cannot spoil the rest.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "usageMetadata")]
    usage_metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    message: Option<&'a RawValue>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Holder<'a> {
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

/// Every usage field seen so far; later values override earlier ones. What they mean is each
/// format's to say ([`UsageFields::usage`]).
type Fields = UsageFields;

/// Merges a raw `usage` value (JSON text) into `fields`; `null` or an unexpected shape is
/// ignored.
fn merge_json(fields: &mut Fields, json: &[u8]) {
    if let Ok(Some(raw)) = serde_json::from_slice::<Option<RawUsage>>(json) {
        merge(fields, raw);
    }
}

fn merge(fields: &mut Fields, raw: RawUsage) {
    fn set(slot: &mut Option<u64>, value: Option<u64>) {
        if value.is_some() {
            *slot = value;
        }
    }
    set(&mut fields.prompt_token_count, raw.prompt_token_count);
    set(
        &mut fields.candidates_token_count,
        raw.candidates_token_count,
    );
    set(&mut fields.thoughts_token_count, raw.thoughts_token_count);
    set(
        &mut fields.cached_content_token_count,
        raw.cached_content_token_count,
    );
    set(&mut fields.prompt_tokens, raw.prompt_tokens);
    set(&mut fields.completion_tokens, raw.completion_tokens);
    set(&mut fields.input_tokens, raw.input_tokens);
    set(&mut fields.output_tokens, raw.output_tokens);
    set(
        &mut fields.cached_tokens,
        raw.prompt_tokens_details.and_then(|d| d.cached_tokens),
    );
    set(
        &mut fields.cached_tokens,
        raw.input_tokens_details.and_then(|d| d.cached_tokens),
    );
    set(
        &mut fields.cache_read_input_tokens,
        raw.cache_read_input_tokens,
    );
    set(
        &mut fields.cache_creation_input_tokens,
        raw.cache_creation_input_tokens,
    );
}

/// The bytes that matter inside a value outside strings: strings and brackets.
const VALUE_STRUCTURE: [bool; 256] = {
    let mut table = [false; 256];
    table[b'"' as usize] = true;
    table[b'{' as usize] = true;
    table[b'}' as usize] = true;
    table[b'[' as usize] = true;
    table[b']' as usize] = true;
    table
};

/// The bytes that matter at the top level outside strings: those of [`VALUE_STRUCTURE`], and
/// the commas and colons between members.
const MEMBER_STRUCTURE: [bool; 256] = {
    let mut table = VALUE_STRUCTURE;
    table[b',' as usize] = true;
    table[b':' as usize] = true;
    table
};

/// Incremental scan of one JSON document for its top-level `usage` value.
#[derive(Debug, Default)]
struct JsonScan {
    /// Nesting depth before the current byte (1 = inside the top-level object).
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// At depth 1, the next string is a key.
    expect_key: bool,
    /// Inside a key string at depth 1.
    in_key: bool,
    /// The current key's first bytes (enough to recognise `usage` and `usageMetadata`).
    key: [u8; 14],
    key_len: usize,
    /// A key just closed; waiting for its `:`.
    after_key: bool,
    /// Copying the bytes of the `usage` value.
    capturing: bool,
    capture: Vec<u8>,
    /// Nothing more to learn: the document ended, is not an object, or the value was too big.
    stopped: bool,
    fields: Fields,
}

impl JsonScan {
    fn feed(&mut self, chunk: &[u8]) {
        let mut i = 0;
        while i < chunk.len() && !self.stopped {
            // Fast paths, copying what they pass over when capturing: a string's contents up
            // to a quote or backslash (a key's noted too), and outside strings everything up
            // to a string or a bracket, and at the top level a comma or colon (only those
            // matter there).
            if self.in_string && !self.escaped {
                let n = memchr::memchr2(b'"', b'\\', &chunk[i..]);
                let run = &chunk[i..i + n.unwrap_or(chunk.len() - i)];
                if self.in_key {
                    self.key_run(run);
                }
                if !self.keep_run(run) {
                    return;
                }
                match n {
                    Some(n) => i += n,
                    None => return,
                }
            } else if !self.in_string && self.depth >= 1 {
                let structure = if self.depth == 1 {
                    &MEMBER_STRUCTURE
                } else {
                    &VALUE_STRUCTURE
                };
                let n = chunk[i..].iter().position(|&b| structure[usize::from(b)]);
                if !self.keep_run(&chunk[i..i + n.unwrap_or(chunk.len() - i)]) {
                    return;
                }
                match n {
                    Some(n) => i += n,
                    None => return,
                }
            }
            if self.in_string {
                self.string_byte(chunk[i]);
            } else {
                self.structural_byte(chunk[i]);
            }
            i += 1;
        }
    }

    fn string_byte(&mut self, b: u8) {
        self.keep(b);
        if self.escaped {
            self.escaped = false;
            self.key_byte(b);
        } else if b == b'\\' {
            self.escaped = true;
            self.key_byte(b);
        } else if b == b'"' {
            self.in_string = false;
            if self.in_key {
                self.in_key = false;
                self.after_key = true;
            }
        } else {
            self.key_byte(b);
        }
    }

    /// A run of a key's bytes (no quote or backslash among them).
    fn key_run(&mut self, run: &[u8]) {
        let take = run.len().min(self.key.len().saturating_sub(self.key_len));
        if let (Some(to), Some(from)) = (
            self.key.get_mut(self.key_len..self.key_len + take),
            run.get(..take),
        ) {
            to.copy_from_slice(from);
        }
        self.key_len = self.key_len.saturating_add(run.len());
    }

    fn key_byte(&mut self, b: u8) {
        if self.in_key {
            self.key_run(&[b]);
        }
    }

    fn structural_byte(&mut self, b: u8) {
        match b {
            b'"' => {
                self.keep(b);
                self.in_string = true;
                if self.depth == 1 && self.expect_key {
                    self.expect_key = false;
                    self.in_key = true;
                    self.key_len = 0;
                }
            }
            b'{' | b'[' => {
                if self.depth == 0 {
                    if b != b'{' {
                        self.stopped = true;
                        return;
                    }
                    self.expect_key = true;
                }
                self.keep(b);
                self.depth = self.depth.saturating_add(1);
            }
            b'}' | b']' => {
                if self.depth == 1 {
                    self.end_capture();
                    self.stopped = true;
                } else {
                    self.keep(b);
                }
                self.depth = self.depth.saturating_sub(1);
            }
            b',' if self.depth == 1 => {
                self.end_capture();
                self.expect_key = true;
            }
            b':' if self.depth == 1 && self.after_key => {
                self.after_key = false;
                let key = &self.key[..self.key_len.min(self.key.len())];
                if key == b"usage" || key == b"usageMetadata" {
                    self.capturing = true;
                    self.capture.clear();
                    // Room for a usage object with its details at once, not grown byte by byte.
                    self.capture.reserve(USAGE_CAPACITY);
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' if self.depth == 0 => {}
            _ if self.depth == 0 => self.stopped = true,
            _ => self.keep(b),
        }
    }

    /// Appends bytes of the `usage` value while capturing; gives up past the limit (and
    /// answers `false`: stopped).
    fn keep_run(&mut self, run: &[u8]) -> bool {
        if self.capturing {
            if self.capture.len() + run.len() > JSON_CAPTURE_LIMIT {
                self.capturing = false;
                self.capture = Vec::new();
                self.stopped = true;
                return false;
            }
            self.capture.extend_from_slice(run);
        }
        true
    }

    /// Appends a byte of the `usage` value while capturing; gives up past the limit.
    fn keep(&mut self, b: u8) {
        if self.capturing {
            if self.capture.len() >= JSON_CAPTURE_LIMIT {
                self.capturing = false;
                self.capture = Vec::new();
                self.stopped = true;
                return;
            }
            self.capture.push(b);
        }
    }

    fn end_capture(&mut self) {
        if self.capturing {
            self.capturing = false;
            merge_json(&mut self.fields, &self.capture);
            self.capture = Vec::new();
        }
    }
}

/// Incremental scan of a server-sent event stream.
#[derive(Debug, Default)]
struct SseScan {
    /// The current incomplete line.
    line: Vec<u8>,
    /// The current line grew past the limit: drop bytes until its end.
    skipping: bool,
    /// The current event's data lines, joined by `\n`.
    data: Vec<u8>,
    /// The current event's data grew past the limit: ignore the event.
    data_overflow: bool,
    fields: Fields,
}

impl SseScan {
    fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            let head = &rest[..nl];
            rest = &rest[nl + 1..];
            if self.skipping {
                self.skipping = false;
            } else if self.line.len() + head.len() > SSE_LINE_LIMIT {
                self.drop_line(head);
            } else if self.line.is_empty() {
                self.line_done(head);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.line_done(&line);
                line.clear();
                if line.capacity() <= KEEP_CAPACITY {
                    self.line = line;
                }
            }
        }
        if self.skipping || rest.is_empty() {
            return;
        }
        if self.line.len() + rest.len() > SSE_LINE_LIMIT {
            self.drop_line(rest);
            self.skipping = true;
        } else {
            self.line.extend_from_slice(rest);
        }
    }

    /// Drops the current line, too long to keep (`more` continues it). A line is dropped by
    /// its length alone, and a dropped `data` line spoils its event, so whether the line came
    /// whole or in pieces (as the network cut it) does not change what is found.
    fn drop_line(&mut self, more: &[u8]) {
        let held = self.line.len().min(5);
        let mut start = self.line[..held].to_vec();
        start.extend(more.iter().take(5 - held));
        if start == b"data:" {
            self.data_overflow = true;
            self.data = Vec::new();
        }
        self.line = Vec::new();
    }

    /// The stream ended: a last line or event without its terminator still counts.
    fn finish(&mut self) {
        if !self.skipping && !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line);
        }
        self.dispatch();
    }

    fn line_done(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            self.dispatch();
            return;
        }
        let Some(value) = line.strip_prefix(b"data:") else {
            // `event:`, `id:`, `retry:`, comments: the data's own `type` says enough.
            return;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if self.data_overflow {
            return;
        }
        if self.data.len() + value.len() + 1 > SSE_LINE_LIMIT {
            self.data_overflow = true;
            self.data = Vec::new();
            return;
        }
        if !self.data.is_empty() {
            self.data.push(b'\n');
        }
        self.data.extend_from_slice(value);
    }

    fn dispatch(&mut self) {
        if !self.data_overflow && names_usage(&self.data) {
            if let Ok(event) = serde_json::from_slice::<Event>(&self.data) {
                let found = [
                    event.usage,
                    event.usage_metadata,
                    nested_usage(event.message),
                    nested_usage(event.response),
                ];
                for usage in found.into_iter().flatten() {
                    merge_json(&mut self.fields, usage.get().as_bytes());
                }
            }
        }
        self.data_overflow = false;
        self.data.clear();
        if self.data.capacity() > KEEP_CAPACITY {
            self.data = Vec::new();
        }
    }
}

/// The `usage` member of an object such as Anthropic's `message` or Responses' `response`.
fn nested_usage(holder: Option<&RawValue>) -> Option<&RawValue> {
    serde_json::from_str::<Holder>(holder?.get()).ok()?.usage
}

/// Whether an event's data may hold a `usage` to read: it names `"usage"` other than as a key
/// whose value is `null`. With `stream_options.include_usage`, OpenAI writes `"usage":null`
/// into every Chat Completions chunk before the last; parsing each of them was most of the
/// time a streamed answer spent in compactor.
fn names_usage(data: &[u8]) -> bool {
    // `"usage"` or Gemini's `"usageMetadata"`, found in one search for what they share.
    const STEM: &[u8] = b"\"usage";
    // Built once: a searcher's setup cost more than a short event's search.
    static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(STEM));
    FINDER.find_iter(data).any(|at| {
        let rest = &data[at + STEM.len()..];
        let Some(after) = rest
            .strip_prefix(b"\"")
            .or_else(|| rest.strip_prefix(b"Metadata\""))
        else {
            return false;
        };
        match after.trim_ascii_start().strip_prefix(b":") {
            Some(value) => !value.trim_ascii_start().starts_with(b"null"),
            // Not a key (a string value): parsed, to be safe.
            None => true,
        }
    })
}

#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod tests;
