//! Fuzz tests of the response usage scanner: JSON and SSE bodies of the three APIs, generated
//! with arbitrary counts (up to `u64::MAX`, where the Anthropic sum saturates) around text
//! holding decoy `"usage"` keys, the hand-written samples of `usage::tests` put through
//! byte mutations, and arbitrary bytes, each delivered in arbitrary chunks.
//!
//! What must hold: no panic; a scanner is a function of the bytes, whatever the chunking
//! (every input, mutated or not, finds the same usage in one piece and in chunks); a
//! generated response finds exactly the usage it was written with; and a body observed on its
//! way to the client ([`Observed`], plain or compressed, readable or not) passes through
//! byte-identical with the completion callback run once.
//!
//! `COMPACTOR_FUZZ_CASES` sets the number of cases of each property (docs/fuzzing.md).

use std::collections::VecDeque;

use bytes::Bytes;
use futures_util::FutureExt;
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::json;

use super::tests::{callback, calls_of, compress, samples, Frames};
use super::{Encoding, Format, Observed, Scanner, Usage};
use crate::testing::fuzz::{self, chunks, mutate, mutations};

/// Cases of each property in a default (CI) run.
const SHORT_RUN: u32 = 256;

fn scan(format: Format, chunks: &[&[u8]]) -> Option<Usage> {
    let mut s = Scanner::new(format);
    for chunk in chunks {
        s.feed(chunk);
    }
    s.finish()
}

fn format() -> impl Strategy<Value = Format> {
    prop_oneof![Just(Format::Json), Just(Format::Sse)]
}

fn encoding() -> impl Strategy<Value = Encoding> {
    prop_oneof![
        Just(Encoding::Identity),
        Just(Encoding::Gzip),
        Just(Encoding::Deflate)
    ]
}

/// Where a chunked delivery cuts the body: a few random points, or every byte.
fn cuts() -> impl Strategy<Value = Option<Vec<usize>>> {
    prop_oneof![
        4 => proptest::collection::vec(any::<usize>(), 0..12).prop_map(Some),
        1 => Just(None),
    ]
}

fn delivered<'b>(bytes: &'b [u8], cuts: &Option<Vec<usize>>) -> Vec<&'b [u8]> {
    match cuts {
        Some(cuts) => chunks(bytes, cuts),
        None => bytes.chunks(1).collect(),
    }
}

/// Token counts, small or anywhere in `u64`.
fn count() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 0u64..100_000, 1 => any::<u64>()]
}

/// Text a response carries, sometimes with a decoy `usage` object inside it.
fn text() -> impl Strategy<Value = String> {
    let plain = "[a-z \"\\\\\n\r{}:,é🦀]{0,40}";
    prop_oneof![
        plain,
        (plain, plain).prop_map(|(a, b)| format!(
            "{a}\"usage\": {{\"prompt_tokens\": 7, \"input_tokens\": 9}}\n\ndata: {{\"usage\":{{}}}}{b}"
        )),
    ]
}

#[derive(Debug, Clone, Copy)]
enum Api {
    Chat,
    Anthropic,
    Responses,
}

/// A generated response, its format and the usage it reports.
#[derive(Debug, Clone)]
struct Response {
    format: Format,
    body: Vec<u8>,
    usage: Usage,
}

#[derive(Debug, Clone)]
struct Spec {
    api: Api,
    format: Format,
    input: u64,
    output: u64,
    cached: u64,
    written: u64,
    texts: Vec<String>,
    usage_first: bool,
    crlf: bool,
    space: bool,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop_oneof![Just(Api::Chat), Just(Api::Anthropic), Just(Api::Responses)],
        format(),
        (count(), count(), count(), count()),
        proptest::collection::vec(text(), 1..4),
        (any::<bool>(), any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(api, format, (input, output, cached, written), texts, (usage_first, crlf, space))| {
                Spec {
                    api,
                    format,
                    input,
                    output,
                    cached,
                    written,
                    texts,
                    usage_first,
                    crlf,
                    space,
                }
            },
        )
}

/// The response `spec` describes, written as the provider writes it.
fn response(s: &Spec) -> Response {
    let usage = match s.api {
        Api::Chat => json!({"prompt_tokens": s.input, "completion_tokens": s.output,
                            "total_tokens": s.input.saturating_add(s.output),
                            "prompt_tokens_details": {"cached_tokens": s.cached, "audio_tokens": 0}}),
        Api::Anthropic => json!({"input_tokens": s.input, "cache_creation_input_tokens": s.written,
                                 "cache_read_input_tokens": s.cached, "output_tokens": s.output}),
        Api::Responses => {
            json!({"input_tokens": s.input, "input_tokens_details": {"cached_tokens": s.cached},
                                 "output_tokens": s.output, "output_tokens_details": {"reasoning_tokens": 0}})
        }
    };
    let expected = match s.api {
        Api::Chat | Api::Responses => Usage {
            input: s.input,
            output: s.output,
            cache_read: s.cached,
            cache_write: 0,
        },
        Api::Anthropic => Usage {
            input: s.input.saturating_add(s.cached).saturating_add(s.written),
            output: s.output,
            cache_read: s.cached,
            cache_write: s.written,
        },
    };
    let text = |i: usize| json!(s.texts[i % s.texts.len()]).to_string();
    let body = match s.format {
        Format::Json => {
            let content = match s.api {
                Api::Chat => format!(
                    r#""choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"meta":{{"usage":{{"prompt_tokens":1}}}}}}]"#,
                    text(0)
                ),
                Api::Anthropic => format!(r#""content":[{{"type":"text","text":{}}}]"#, text(0)),
                Api::Responses => format!(
                    r#""output":[{{"type":"message","content":[{{"type":"output_text","text":{}}}]}}],"tools":[{{"name":"usage"}}]"#,
                    text(0)
                ),
            };
            let usage = format!(r#""usage":{usage}"#);
            let (a, b) = if s.usage_first {
                (usage, content)
            } else {
                (content, usage)
            };
            format!(r#"{{"id":"x",{a},{b},"model":"m"}}"#)
        }
        Format::Sse => {
            let mut events: Vec<(Option<&str>, String)> = Vec::new();
            match s.api {
                Api::Chat => {
                    for i in 0..s.texts.len() {
                        events.push((
                            None,
                            format!(
                                r#"{{"choices":[{{"delta":{{"content":{}}}}}],"usage":null}}"#,
                                text(i)
                            ),
                        ));
                    }
                    events.push((None, format!(r#"{{"choices":[],"usage":{usage}}}"#)));
                    events.push((None, "[DONE]".into()));
                }
                Api::Anthropic => {
                    let mut start = usage.clone();
                    start["output_tokens"] = json!(1);
                    events.push((Some("message_start"), format!(r#"{{"type":"message_start","message":{{"id":"m","content":[],"usage":{start}}}}}"#)));
                    for i in 0..s.texts.len() {
                        events.push((Some("content_block_delta"), format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{}}}}}"#, text(i))));
                    }
                    events.push((Some("message_delta"), format!(r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn"}},"usage":{{"output_tokens":{}}}}}"#, s.output)));
                    events.push((Some("message_stop"), r#"{"type":"message_stop"}"#.into()));
                }
                Api::Responses => {
                    events.push((
                        Some("response.created"),
                        r#"{"type":"response.created","response":{"id":"r","usage":null}}"#.into(),
                    ));
                    for i in 0..s.texts.len() {
                        events.push((
                            Some("response.output_text.delta"),
                            format!(
                                r#"{{"type":"response.output_text.delta","delta":{}}}"#,
                                text(i)
                            ),
                        ));
                    }
                    events.push((Some("response.completed"), format!(r#"{{"type":"response.completed","response":{{"id":"r","status":"completed","usage":{usage}}}}}"#)));
                }
            }
            let nl = if s.crlf { "\r\n" } else { "\n" };
            let sp = if s.space { " " } else { "" };
            events
                .iter()
                .map(|(event, data)| match event {
                    Some(e) => format!("event:{sp}{e}{nl}data:{sp}{data}{nl}{nl}"),
                    None => format!("data:{sp}{data}{nl}{nl}"),
                })
                .collect()
        }
    };
    Response {
        format: s.format,
        body: body.into_bytes(),
        usage: expected,
    }
}

/// Bytes to scan: generated responses and the samples, mutated or not, and arbitrary bytes.
fn any_body() -> impl Strategy<Value = (Format, Vec<u8>)> {
    let sample = (0..samples().len(), mutations(0, 4)).prop_map(|(i, ms)| {
        let (_, format, body, _) = samples()[i];
        (format, mutate(body.as_bytes(), &ms))
    });
    prop_oneof![
        2 => (spec(), mutations(0, 4)).prop_map(|(s, ms)| {
            let r = response(&s);
            (r.format, mutate(&r.body, &ms))
        }),
        2 => sample,
        1 => (format(), fuzz::bytes(1024)),
    ]
}

proptest! {
    #![proptest_config(fuzz::config(SHORT_RUN, file!()))]

    /// A generated response gives the usage it was written with, in one piece and in any
    /// chunks.
    #[test]
    fn generated_responses_give_their_usage_in_any_chunks(s in spec(), cuts in cuts()) {
        let r = response(&s);
        prop_assert_eq!(scan(r.format, &[&r.body]), Some(r.usage));
        prop_assert_eq!(scan(r.format, &delivered(&r.body, &cuts)), Some(r.usage));
    }

    /// Any bytes, read as either format: no panic, and the same usage in one piece as in
    /// any chunks.
    #[test]
    fn any_bytes_scan_alike_in_any_chunks((format, body) in any_body(), cuts in cuts()) {
        let whole = scan(format, &[&body]);
        let other = match format {
            Format::Json => Format::Sse,
            Format::Sse => Format::Json,
        };
        let _ = scan(other, &[&body]);
        prop_assert_eq!(scan(format, &delivered(&body, &cuts)), whole);
    }

    /// Any body observed on its way to the client, compressed or not (uncompressed bytes
    /// sent as gzip or deflate reach the decompressor as garbage), reaches the client
    /// byte-identical with the callback run once; a readable body gives the usage of its
    /// plain bytes.
    #[test]
    fn observed_bodies_pass_through_byte_identical(
        (format, body) in any_body(),
        encoding in encoding(),
        compressed in any::<bool>(),
        cuts in cuts(),
    ) {
        let wire = if compressed { compress(&body, encoding) } else { body.clone() };
        let frames: VecDeque<Bytes> = delivered(&wire, &cuts)
            .into_iter()
            .map(Bytes::copy_from_slice)
            .collect();
        let (calls, on_done) = callback();
        let observed = Observed::new(Frames(frames), Some(format), on_done).encoded(encoding);
        let out = observed
            .collect()
            .now_or_never()
            .expect("a body of ready frames completes at once");
        let Ok(out) = out;
        prop_assert_eq!(out.to_bytes(), Bytes::from(wire.clone()));
        let calls = calls_of(&calls);
        prop_assert_eq!(calls.len(), 1);
        if compressed || encoding == Encoding::Identity {
            prop_assert_eq!(calls[0], scan(format, &[&body]));
        }
    }
}
