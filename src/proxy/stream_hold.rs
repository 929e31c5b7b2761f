//! The start of a streamed chat answer, held back until it shows content.
//!
//! A provider may refuse a request for its length inside a `200` event stream instead of with
//! an error status (OpenAI Responses' `response.failed`, an Anthropic `error` event, a Chat
//! Completions `{"error": …}` chunk: the shapes are in [`crate::overflow`]'s second table).
//! compactor can compact such a request and send it once more only while no byte of the
//! refused answer has reached the client, so the proxy [`hold`]s a chat stream's first events
//! (its head included) and [`Scan`]s them as they complete:
//!
//! - **preamble** (held): SSE comments, blank lines and events that carry nothing the agent
//!   needs yet: Responses `response.created`, `response.in_progress`, `response.queued`;
//!   Anthropic `message_start` and `ping`; a Chat Completions chunk whose deltas hold a `role`
//!   and nothing else (or no choices at all);
//! - **content** (released): any other event; the held bytes go out, then the rest of the
//!   stream as it comes, byte for byte;
//! - **a refusal for length** before any content: [`Held::Refused`]; the proxy compacts and
//!   sends the request again, and the client sees only the second answer (or, when nothing
//!   smaller can be sent, the held bytes and the rest, as the provider sent them).
//!
//! Fail open: a stream that ends, breaks off or sends trailers during the preamble, one whose
//! preamble grows past [`HOLD_LIMIT`] bytes, and one that shows no content within the time
//! given (the upstream response timeout) is released as it is: the held bytes, then whatever
//! ended the hold (the error, the trailers) or the rest of the stream. A working stream never
//! becomes an error and no byte is lost. An event that cannot be read (not JSON where JSON
//! was expected, an error that is not about length) counts as content.
//!
//! It is cheap: only the events before the first content are looked at, and of those only
//! the event name, or without one the data's top-level `"type"` (the first key providers
//! write), found without parsing the rest; a Chat Completions chunk, which has no type, is
//! parsed to see whether its deltas hold anything (the first chunks are a few hundred bytes).
//! The error event of a refusal is parsed whole. After the first content event nothing is
//! scanned: the stream passes through untouched.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::dialect::DialectKind;
use crate::overflow::{recognise_streamed, Overflow};
use crate::timing::Overhead;

/// The most bytes held before the first content event; a longer preamble is released as it is.
/// More than the 64 KiB an error body is read to: Responses' `response.created` and
/// `response.in_progress` each repeat the request's `instructions` and `tools`, which for a
/// coding agent (Codex) are tens of KB.
pub const HOLD_LIMIT: usize = 256 * 1024;

/// How the held start of a stream ended.
pub enum Held<B: Body> {
    /// To pass on: content came, or the hold failed open.
    Pass(Released<B>),
    /// The provider refused the request for its length before any content; the body is the
    /// refused answer, to pass on if the request cannot be sent again.
    Refused(Released<B>, Overflow),
}

/// Holds `body` (a `200` event stream answering a request of `dialect`) until its first
/// content event, a refusal for length, its end or error, [`HOLD_LIMIT`] bytes, or `within`;
/// the time spent waiting on the upstream is excluded from `overhead`.
pub async fn hold<B>(
    mut body: B,
    dialect: DialectKind,
    within: Duration,
    overhead: &mut Overhead,
) -> Held<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut held = Holding::default();
    let mut scan = Scan::new(dialect);
    let then = loop {
        // Cancel-safe: a frame not yet taken stays in `body`.
        let polled = overhead
            .wait(tokio::time::timeout_at(deadline, body.frame()))
            .await;
        let frame = match polled {
            Err(_) => break Then::Rest(body),
            Ok(None) => break Then::End,
            Ok(Some(Err(e))) => {
                break Then::Error {
                    error: Some(e),
                    yielded: false,
                }
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => match frame.into_trailers() {
                Ok(trailers) => break Then::Trailers(Some(trailers)),
                Err(_) => continue,
            },
        };
        match scan.feed(held.push(data)) {
            Verdict::Undecided if held.len() <= HOLD_LIMIT => {}
            Verdict::Refusal(overflow) => {
                return Held::Refused(Released::new(held.take(), Then::Rest(body)), overflow)
            }
            Verdict::Undecided | Verdict::Content => break Then::Rest(body),
        }
    };
    Held::Pass(Released::new(held.take(), then))
}

/// The bytes held so far: the first frame as it came (most streams show content in it, and
/// it is released without a copy), then, from a second frame on, all of them in one buffer
/// (an event can straddle frames).
#[derive(Default)]
struct Holding {
    first: Option<Bytes>,
    joined: BytesMut,
}

impl Holding {
    /// Holds `data` too; everything held so far, in order.
    fn push(&mut self, data: Bytes) -> &[u8] {
        if self.first.is_none() && self.joined.is_empty() {
            return self.first.insert(data);
        }
        if let Some(first) = self.first.take() {
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(&data);
        &self.joined
    }

    fn len(&self) -> usize {
        self.first.as_ref().map_or(self.joined.len(), Bytes::len)
    }

    fn take(&mut self) -> Bytes {
        match self.first.take() {
            Some(first) => first,
            None => std::mem::take(&mut self.joined).freeze(),
        }
    }
}

/// A held stream on its way to the client: the held bytes, then what ended the hold or the
/// rest of the stream.
pub struct Released<B: Body> {
    held: Option<Bytes>,
    then: Then<B>,
}

/// What follows the held bytes.
enum Then<B: Body> {
    /// The rest of the stream, as it comes.
    Rest(B),
    /// The error that broke the stream off during the hold, then the end. It waits for one
    /// poll after the held bytes (`yielded`), so that the server writes them out before it
    /// gives up the connection for the error.
    Error {
        error: Option<B::Error>,
        yielded: bool,
    },
    /// The trailers that ended the stream during the hold, then the end.
    Trailers(Option<HeaderMap>),
    /// Nothing: the stream ended during the hold.
    End,
}

impl<B: Body> Released<B> {
    fn new(held: Bytes, then: Then<B>) -> Released<B> {
        Released {
            held: (!held.is_empty()).then_some(held),
            then,
        }
    }
}

// Nothing in it is pinned in place: the stream is polled through `Pin::new` (it is `Unpin`),
// and the held error and trailers are only moved out.
impl<B: Body + Unpin> Unpin for Released<B> {}

impl<B> Body for Released<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if let Some(held) = this.held.take() {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        match &mut this.then {
            Then::Rest(body) => Pin::new(body).poll_frame(cx),
            Then::Error { yielded, .. } if !*yielded => {
                *yielded = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Then::Error { error, .. } => Poll::Ready(error.take().map(Err)),
            Then::Trailers(t) => Poll::Ready(t.take().map(|t| Ok(Frame::trailers(t)))),
            Then::End => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none()
            && match &self.then {
                Then::Rest(body) => body.is_end_stream(),
                Then::Error { error, .. } => error.is_none(),
                Then::Trailers(t) => t.is_none(),
                Then::End => true,
            }
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.held.as_ref().map_or(0, |h| h.len() as u64);
        // A stream that broke off or sent trailers must not look complete: with an exact size
        // an HTTP/1 answer would be sent with a `Content-Length`, losing the cut or the
        // trailers.
        let rest = match &self.then {
            Then::Rest(body) => body.size_hint(),
            Then::Error { .. } | Then::Trailers(_) => SizeHint::new(),
            Then::End => SizeHint::with_exact(0),
        };
        // The upper bound first: `set_lower` asserts it stays at most the upper one.
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint.set_lower(rest.lower().saturating_add(held));
        hint
    }
}

/// What the events scanned so far say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Preamble only, or nothing complete yet: hold on.
    Undecided,
    /// A content event: release.
    Content,
    /// A refusal for length before any content.
    Refusal(Overflow),
}

/// An SSE scanner over the held bytes, fed the whole held buffer each time it grows; it looks
/// at each complete line once.
pub struct Scan {
    dialect: DialectKind,
    /// Where the first line not yet looked at starts.
    at: usize,
    /// The current event's `event:` value.
    name: Option<Range<usize>>,
    /// The current event's `data:` values.
    data: Vec<Range<usize>>,
}

impl Scan {
    /// A scanner for a stream answering a request of `dialect`.
    pub fn new(dialect: DialectKind) -> Scan {
        Scan {
            dialect,
            at: 0,
            name: None,
            data: Vec::new(),
        }
    }

    /// Looks at the complete lines of `held` (everything held so far: what was fed before,
    /// then the new bytes) not yet looked at.
    pub fn feed(&mut self, held: &[u8]) -> Verdict {
        if self.at == 0 && held.starts_with(b"\xEF\xBB\xBF") {
            self.at = 3;
        }
        while let Some((line, next)) = next_line(held, self.at) {
            self.at = next;
            if line.is_empty() {
                match self.dispatch(held) {
                    Class::Preamble => continue,
                    Class::Content => return Verdict::Content,
                    Class::Refusal(overflow) => return Verdict::Refusal(overflow),
                }
            }
            let text = &held[line.clone()];
            if text.first() == Some(&b':') {
                continue;
            }
            let colon = text.iter().position(|&b| b == b':').unwrap_or(text.len());
            let mut value = (line.start + colon + 1).min(line.end)..line.end;
            if held.get(value.start) == Some(&b' ') && !value.is_empty() {
                value.start += 1;
            }
            match &text[..colon] {
                b"event" => self.name = Some(value),
                b"data" => self.data.push(value),
                _ => {}
            }
        }
        Verdict::Undecided
    }

    /// Classifies the event that a blank line just ended, and starts the next.
    fn dispatch(&mut self, held: &[u8]) -> Class {
        let name = self.name.take().map(|r| &held[r]);
        let data: Cow<'_, [u8]> = match self.data.as_slice() {
            [] => Cow::Borrowed(&[]),
            [one] => Cow::Borrowed(&held[one.clone()]),
            several => Cow::Owned(
                several
                    .iter()
                    .map(|r| &held[r.clone()])
                    .collect::<Vec<_>>()
                    .join(&b'\n'),
            ),
        };
        self.data.clear();
        classify(self.dialect, name, &data)
    }
}

/// The next complete line of `held` from `at` (its range, without the line break) and where
/// the one after it starts. A `\r` at the very end may be the first half of `\r\n`: not yet.
fn next_line(held: &[u8], at: usize) -> Option<(Range<usize>, usize)> {
    let rest = held.get(at..)?;
    let end = at + rest.iter().position(|&b| b == b'\n' || b == b'\r')?;
    let next = match (held[end], held.get(end + 1)) {
        (b'\r', Some(b'\n')) => end + 2,
        (b'\r', None) => return None,
        _ => end + 1,
    };
    Some((at..end, next))
}

/// What one event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Preamble,
    Content,
    Refusal(Overflow),
}

/// Classifies one event by its name (or its data's top-level `type`) and, for Chat
/// Completions chunks, whether its deltas hold anything.
fn classify(dialect: DialectKind, name: Option<&[u8]>, data: &[u8]) -> Class {
    if name.is_none() && data.iter().all(u8::is_ascii_whitespace) {
        // No event (an `id:` or `retry:` alone), or an empty one.
        return Class::Preamble;
    }
    if name == Some(b"error") {
        return refusal_or_content(data);
    }
    match dialect {
        DialectKind::ChatCompletions => chat_chunk(data),
        DialectKind::Responses => match name.or_else(|| top_level_type(data)) {
            Some(b"response.created" | b"response.in_progress" | b"response.queued") => {
                Class::Preamble
            }
            Some(b"response.failed" | b"error") => refusal_or_content(data),
            _ => Class::Content,
        },
        DialectKind::Messages => match name.or_else(|| top_level_type(data)) {
            Some(b"message_start" | b"ping") => Class::Preamble,
            Some(b"error") => refusal_or_content(data),
            _ => Class::Content,
        },
        // Every chunk is a whole `GenerateContentResponse`; an error is `{"error": {…}}`.
        DialectKind::Gemini => match serde_json::from_slice::<Chunk<'_>>(data) {
            Ok(chunk) if chunk.error.is_some() => refusal_or_content(data),
            Ok(_) | Err(_) => Class::Content,
        },
    }
}

/// An error event: a refusal for length, or (any other failure) content the agent must see.
fn refusal_or_content(data: &[u8]) -> Class {
    recognise_streamed(data).map_or(Class::Content, Class::Refusal)
}

/// The parts of a Chat Completions chunk that tell a preamble from content.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<BTreeMap<Cow<'a, str>, &'a RawValue>>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
}

impl Choice<'_> {
    /// Nothing yet: no finish, and a delta of a `role` and empty values at most.
    fn is_empty(&self) -> bool {
        self.finish_reason.is_none()
            && self.delta.iter().flatten().all(|(key, value)| {
                key == "role" || matches!(value.get(), "null" | "\"\"" | "[]" | "{}")
            })
    }
}

/// A Chat Completions `data:` payload: the end, an error chunk, or a chunk with or without
/// anything in it.
fn chat_chunk(data: &[u8]) -> Class {
    if data.trim_ascii() == b"[DONE]" {
        return Class::Content;
    }
    match serde_json::from_slice::<Chunk<'_>>(data) {
        Ok(chunk) if chunk.error.is_some() => refusal_or_content(data),
        Ok(chunk) if chunk.choices.iter().all(Choice::is_empty) => Class::Preamble,
        Ok(_) | Err(_) => Class::Content,
    }
}

/// The top-level `"type"` string of a JSON object (its raw bytes, escapes left as they are),
/// found by skipping the keys before it without parsing them: providers write it first.
fn top_level_type(data: &[u8]) -> Option<&[u8]> {
    let mut i = skip_whitespace(data, 0);
    if data.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_whitespace(data, i);
        let key = string_at(data, i)?;
        i = skip_whitespace(data, key.end + 1);
        if data.get(i) != Some(&b':') {
            return None;
        }
        i = skip_whitespace(data, i + 1);
        if &data[key] == b"type" {
            return string_at(data, i).map(|value| &data[value]);
        }
        i = skip_whitespace(data, skip_value(data, i)?);
        if data.get(i) != Some(&b',') {
            return None;
        }
        i += 1;
    }
}

fn skip_whitespace(data: &[u8], mut i: usize) -> usize {
    while data.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The contents of the JSON string opening at `i` (without its quotes); its closing quote is
/// at the range's end.
fn string_at(data: &[u8], i: usize) -> Option<Range<usize>> {
    if data.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match data.get(j)? {
            b'"' => return Some(i + 1..j),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// Where the JSON value starting at `i` ends (one past its last byte).
fn skip_value(data: &[u8], i: usize) -> Option<usize> {
    match data.get(i)? {
        b'"' => Some(string_at(data, i)?.end + 1),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match data.get(j)? {
                    b'"' => j = string_at(data, j)?.end,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => Some(
            i + data[i..]
                .iter()
                .position(|&b| matches!(b, b',' | b'}' | b']') || b.is_ascii_whitespace())
                .unwrap_or(data.len() - i),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    const RESPONSES_PREAMBLE: &str = "event: response.created\n\
        data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"instructions\":\"You are Codex.\",\"error\":null}}\n\n\
        event: response.in_progress\n\
        data: {\"type\":\"response.in_progress\",\"sequence_number\":1,\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"error\":null}}\n\n";
    const RESPONSES_FAILED: &str = "event: response.failed\n\
        data: {\"type\":\"response.failed\",\"sequence_number\":2,\"response\":{\"id\":\"resp_1\",\"status\":\"failed\",\"error\":{\"code\":\"context_length_exceeded\",\"message\":\"Your input exceeds the context window of this model. Please adjust your input and try again.\"}}}\n\n";
    const RESPONSES_CONTENT: &str = "event: response.output_item.added\n\
        data: {\"type\":\"response.output_item.added\",\"sequence_number\":2,\"output_index\":0,\"item\":{\"type\":\"message\"}}\n\n";
    const ANTHROPIC_PREAMBLE: &str = "event: message_start\n\
        data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n\
        event: ping\ndata: {\"type\": \"ping\"}\n\n";
    const ANTHROPIC_ERROR: &str = "event: error\n\
        data: {\"type\":\"error\",\"error\":{\"type\":\"invalid_request_error\",\"message\":\"prompt is too long: 208317 tokens > 200000 maximum\"}}\n\n";
    const CHAT_ROLE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}]}\n\n";
    const CHAT_ERROR: &str = "data: {\"error\":{\"message\":\"This model's maximum context length is 4096 tokens. However, your messages resulted in 6100 tokens.\",\"type\":\"invalid_request_error\",\"code\":\"context_length_exceeded\"}}\n\n";

    fn verdict(dialect: DialectKind, stream: &str) -> Verdict {
        Scan::new(dialect).feed(stream.as_bytes())
    }

    /// Fed in pieces of every size: the verdict never depends on where frames split.
    fn verdict_in_pieces(dialect: DialectKind, stream: &str) -> Verdict {
        let whole = verdict(dialect, stream);
        for size in 1..=7 {
            let mut scan = Scan::new(dialect);
            let mut held = Vec::new();
            let mut got = Verdict::Undecided;
            for piece in stream.as_bytes().chunks(size) {
                held.extend_from_slice(piece);
                got = scan.feed(&held);
                if got != Verdict::Undecided {
                    break;
                }
            }
            assert_eq!(got, whole, "pieces of {size}");
        }
        whole
    }

    fn length(window: Option<usize>, requested: Option<usize>) -> Verdict {
        Verdict::Refusal(Overflow { window, requested })
    }

    #[test]
    fn preambles_are_held_and_the_first_content_releases() {
        use DialectKind::*;
        assert_eq!(
            verdict_in_pieces(Responses, RESPONSES_PREAMBLE),
            Verdict::Undecided
        );
        assert_eq!(
            verdict_in_pieces(
                Responses,
                &format!("{RESPONSES_PREAMBLE}{RESPONSES_CONTENT}")
            ),
            Verdict::Content
        );
        assert_eq!(
            verdict_in_pieces(Messages, ANTHROPIC_PREAMBLE),
            Verdict::Undecided
        );
        assert_eq!(
            verdict_in_pieces(
                Messages,
                &format!("{ANTHROPIC_PREAMBLE}event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0}}\n\n")
            ),
            Verdict::Content
        );
        assert_eq!(
            verdict_in_pieces(ChatCompletions, CHAT_ROLE),
            Verdict::Undecided
        );
        for content in [
            r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1"}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"Let me"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
            "not json",
        ] {
            assert_eq!(
                verdict_in_pieces(ChatCompletions, &format!("{CHAT_ROLE}data: {content}\n\n")),
                Verdict::Content,
                "{content}"
            );
        }
        // Comments, keep-alives, an `id:` alone, CRLF line breaks and a byte order mark are
        // preamble too.
        assert_eq!(
            verdict_in_pieces(
                Responses,
                "\u{feff}: keep-alive\r\n\r\nid: 1\r\n\r\n\r\nevent: response.created\r\ndata: {}\r\n\r\n"
            ),
            Verdict::Undecided
        );
        // An event is complete only at its blank line.
        assert_eq!(
            verdict(Responses, RESPONSES_CONTENT.trim_end()),
            Verdict::Undecided
        );
        // Without event names, the data's top-level type tells, wherever it is.
        assert_eq!(
            verdict(
                Responses,
                "data: {\"response\":{\"type\":\"x\",\"n\":[1,{\"a\":\"}\\\"\"}]},\"sequence_number\":0,\"type\":\"response.created\"}\n\n"
            ),
            Verdict::Undecided
        );
        assert_eq!(
            verdict(Messages, "data: {\"type\":\"content_block_delta\"}\n\n"),
            Verdict::Content
        );
    }

    #[test]
    fn a_refusal_for_length_before_content_is_recognised_in_every_dialect() {
        use DialectKind::*;
        assert_eq!(
            verdict_in_pieces(
                Responses,
                &format!("{RESPONSES_PREAMBLE}{RESPONSES_FAILED}")
            ),
            length(None, None)
        );
        assert_eq!(
            verdict_in_pieces(
                Responses,
                "event: error\ndata: {\"type\":\"error\",\"code\":\"context_length_exceeded\",\"message\":\"Your input exceeds the context window of this model.\"}\n\n"
            ),
            length(None, None)
        );
        assert_eq!(
            verdict_in_pieces(Messages, &format!("{ANTHROPIC_PREAMBLE}{ANTHROPIC_ERROR}")),
            length(Some(200_000), Some(208_317))
        );
        assert_eq!(
            verdict_in_pieces(ChatCompletions, CHAT_ERROR),
            length(Some(4096), Some(6100))
        );
        assert_eq!(
            verdict_in_pieces(ChatCompletions, &format!("{CHAT_ROLE}{CHAT_ERROR}")),
            length(Some(4096), Some(6100))
        );
        // Gemini: an error chunk in place of the first answer; a candidates chunk is content.
        assert_eq!(
            verdict_in_pieces(
                Gemini,
                "data: {\"error\":{\"code\":400,\"message\":\"The input token count (1196265) exceeds the maximum number of tokens allowed (1048575).\",\"status\":\"INVALID_ARGUMENT\"}}\r\n\r\n"
            ),
            length(Some(1_048_575), Some(1_196_265))
        );
        assert_eq!(
            verdict_in_pieces(
                Gemini,
                "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hi\"}],\"role\":\"model\"}}]}\r\n\r\n"
            ),
            Verdict::Content
        );
        // Split over two `data:` lines, joined by a line break as SSE says.
        assert_eq!(
            verdict(
                Messages,
                "event: error\ndata: {\"type\":\"error\",\n\
                 data: \"error\":{\"type\":\"invalid_request_error\",\"message\":\"prompt is too long: 9 tokens > 8 maximum\"}}\n\n"
            ),
            length(Some(8), Some(9))
        );
    }

    #[test]
    fn other_failures_and_late_refusals_are_content() {
        use DialectKind::*;
        // A failure not about length is the agent's to see.
        assert_eq!(
            verdict(
                Messages,
                "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
            ),
            Verdict::Content
        );
        // After content nothing is looked at: the first content event decides.
        assert_eq!(
            verdict(Responses, &format!("{RESPONSES_CONTENT}{RESPONSES_FAILED}")),
            Verdict::Content
        );
        // An unknown event is content (fail open).
        assert_eq!(
            verdict(Responses, "event: response.something_new\ndata: {}\n\n"),
            Verdict::Content
        );
    }

    #[test]
    fn the_top_level_type_is_found_without_parsing_the_rest() {
        assert_eq!(top_level_type(br#"{"type":"ping"}"#), Some(&b"ping"[..]));
        assert_eq!(
            top_level_type(
                br#" { "a" : [1, "x]"], "b": {"type": "inner"}, "c": null , "type" : "outer"}"#
            ),
            Some(&b"outer"[..])
        );
        assert_eq!(top_level_type(br#"{"a":1}"#), None);
        assert_eq!(top_level_type(br#"{"a":"#), None);
        assert_eq!(top_level_type(b"[DONE]"), None);
        assert_eq!(top_level_type(br#"{"type":3}"#), None);
        assert_eq!(top_level_type(br#"{"a":"\"#), None);
    }

    type Polled = Result<Frame<Bytes>, &'static str>;
    type Frames = Vec<Polled>;
    type TestBody = StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Polled>>>;

    fn body(frames: Frames) -> TestBody {
        StreamBody::new(futures_util::stream::iter(frames))
    }

    async fn collect<B: Body<Data = Bytes> + Unpin>(mut body: B) -> (Vec<u8>, Option<B::Error>) {
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        out.extend_from_slice(&data);
                    }
                }
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    fn data(s: &str) -> Result<Frame<Bytes>, &'static str> {
        Ok(Frame::data(Bytes::copy_from_slice(s.as_bytes())))
    }

    #[tokio::test]
    async fn held_bytes_are_released_whole_whatever_ends_the_hold() {
        let mut overhead = Overhead::start();
        let within = Duration::from_secs(5);
        let (a, b) = RESPONSES_PREAMBLE.split_at(40);
        // Content: every byte, in order, then the rest.
        let frames = vec![data(a), data(b), data(RESPONSES_CONTENT), data("tail")];
        let Held::Pass(released) =
            hold(body(frames), DialectKind::Responses, within, &mut overhead).await
        else {
            panic!("content releases");
        };
        let (got, error) = collect(released).await;
        assert_eq!(
            got,
            format!("{RESPONSES_PREAMBLE}{RESPONSES_CONTENT}tail").as_bytes()
        );
        assert!(error.is_none());

        // The stream ends during the preamble.
        let Held::Pass(released) = hold(
            body(vec![data(RESPONSES_PREAMBLE)]),
            DialectKind::Responses,
            within,
            &mut overhead,
        )
        .await
        else {
            panic!("the end releases");
        };
        assert!(!released.is_end_stream());
        assert_eq!(
            released.size_hint().exact(),
            Some(RESPONSES_PREAMBLE.len() as u64)
        );
        assert_eq!(
            collect(released).await,
            (RESPONSES_PREAMBLE.as_bytes().to_vec(), None)
        );

        // It breaks off: the bytes, then the error.
        let Held::Pass(released) = hold(
            body(vec![data(ANTHROPIC_PREAMBLE), Err("cut")]),
            DialectKind::Messages,
            within,
            &mut overhead,
        )
        .await
        else {
            panic!("an error releases");
        };
        assert_eq!(
            collect(released).await,
            (ANTHROPIC_PREAMBLE.as_bytes().to_vec(), Some("cut"))
        );

        // Trailers end it: the bytes, then the trailers.
        let mut trailers = HeaderMap::new();
        trailers.insert("x-t", http::HeaderValue::from_static("1"));
        let Held::Pass(mut released) = hold(
            body(vec![data(CHAT_ROLE), Ok(Frame::trailers(trailers))]),
            DialectKind::ChatCompletions,
            within,
            &mut overhead,
        )
        .await
        else {
            panic!("trailers release");
        };
        let first = released
            .frame()
            .await
            .and_then(Result::ok)
            .and_then(|f| f.into_data().ok());
        assert_eq!(first.as_deref(), Some(CHAT_ROLE.as_bytes()));
        let second = released.frame().await.and_then(Result::ok);
        assert!(second.is_some_and(|f| f.is_trailers()));
        assert!(released.frame().await.is_none());
        assert!(released.is_end_stream());

        // More preamble than the bound: released as it is.
        let comment = format!(": {}\n\n", "x".repeat(HOLD_LIMIT));
        let Held::Pass(released) = hold(
            body(vec![data(&comment), data(RESPONSES_FAILED)]),
            DialectKind::Responses,
            within,
            &mut overhead,
        )
        .await
        else {
            panic!("the bound releases");
        };
        assert_eq!(
            collect(released).await.0,
            format!("{comment}{RESPONSES_FAILED}").as_bytes()
        );

        // A refusal: the refused answer is kept whole, in case it must be passed on.
        let Held::Refused(released, overflow) = hold(
            body(vec![
                data(CHAT_ROLE),
                data(CHAT_ERROR),
                data("data: [DONE]\n\n"),
            ]),
            DialectKind::ChatCompletions,
            within,
            &mut overhead,
        )
        .await
        else {
            panic!("a refusal is recognised");
        };
        assert_eq!(overflow.window, Some(4096));
        assert_eq!(
            collect(released).await.0,
            format!("{CHAT_ROLE}{CHAT_ERROR}data: [DONE]\n\n").as_bytes()
        );
    }

    #[tokio::test]
    async fn a_slow_preamble_is_released_after_the_time_given() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, &'static str>>(4);
        tx.send(data(RESPONSES_PREAMBLE)).await.expect("open");
        let body = StreamBody::new(tokio_stream_from(rx));
        let mut overhead = Overhead::start();
        let Held::Pass(mut released) = hold(
            body,
            DialectKind::Responses,
            Duration::from_millis(100),
            &mut overhead,
        )
        .await
        else {
            panic!("the time bound releases");
        };
        let first = released
            .frame()
            .await
            .and_then(Result::ok)
            .and_then(|f| f.into_data().ok());
        assert_eq!(first.as_deref(), Some(RESPONSES_PREAMBLE.as_bytes()));
        tx.send(data(RESPONSES_FAILED)).await.expect("open");
        drop(tx);
        assert_eq!(collect(released).await.0, RESPONSES_FAILED.as_bytes());
        assert!(overhead.excluded() >= Duration::from_millis(100));
    }

    fn tokio_stream_from(
        mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, &'static str>>,
    ) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, &'static str>> + Unpin {
        Box::pin(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)))
    }
}
