use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http::HeaderValue;
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use super::*;

/// Chat Completions, non-streaming: a decoy `usage` inside a string and a nested `usage` key
/// that is not the top-level one.
const CHAT_JSON: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\": {\"prompt_tokens\": 999} \\ ok","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"usage\":{\"prompt_tokens\":7}}"}}]},"logprobs":null,"finish_reason":"stop","meta":{"usage":{"prompt_tokens":5,"completion_tokens":5}}}],"usage":{"prompt_tokens":1200,"completion_tokens":35,"total_tokens":1235,"prompt_tokens_details":{"cached_tokens":1024,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}},"system_fingerprint":"fp_1"}"#;

const CHAT_USAGE: Usage = Usage {
    input: 1200,
    output: 35,
    cache_read: 1024,
    cache_write: 0,
};

const ANTHROPIC_JSON: &str = r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4","content":[{"type":"text","text":"done"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":300,"cache_read_input_tokens":2000,"cache_creation":{"ephemeral_5m_input_tokens":300,"ephemeral_1h_input_tokens":0},"output_tokens":55,"service_tier":"standard"}}"#;

const ANTHROPIC_USAGE: Usage = Usage {
    input: 2312,
    output: 55,
    cache_read: 2000,
    cache_write: 300,
};

/// Responses, non-streaming: `usage` is followed by more fields.
const RESPONSES_JSON: &str = r#"{"id":"resp_1","object":"response","created_at":1,"status":"completed","instructions":"be brief","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"ok","annotations":[]}]}],"tools":[{"type":"function","name":"usage","parameters":{}}],"usage":{"input_tokens":5000,"input_tokens_details":{"cached_tokens":4096},"output_tokens":120,"output_tokens_details":{"reasoning_tokens":64},"total_tokens":5120},"user":null,"metadata":{}}"#;

const RESPONSES_USAGE: Usage = Usage {
    input: 5000,
    output: 120,
    cache_read: 4096,
    cache_write: 0,
};

const CHAT_SSE: &str = concat!(
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n",
    ": keep-alive comment\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\\\"usage\\\"lo\"}}],\"usage\":null}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":12,\"total_tokens\":912,\"prompt_tokens_details\":{\"cached_tokens\":256}}}\n\n",
    "data: [DONE]\n\n",
);

const CHAT_SSE_USAGE: Usage = Usage {
    input: 900,
    output: 12,
    cache_read: 256,
    cache_write: 0,
};

/// Anthropic streaming, with CRLF line endings.
const ANTHROPIC_SSE: &str = concat!(
    "event: message_start\r\n",
    "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude\",\"stop_reason\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":100,\"cache_read_input_tokens\":800,\"output_tokens\":1}}}\r\n\r\n",
    "event: content_block_start\r\n",
    "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\r\n\r\n",
    "event: ping\r\n",
    "data: {\"type\": \"ping\"}\r\n\r\n",
    "event: content_block_delta\r\n",
    "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\r\n\r\n",
    "event: content_block_stop\r\n",
    "data: {\"type\":\"content_block_stop\",\"index\":0}\r\n\r\n",
    "event: message_delta\r\n",
    "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":42}}\r\n\r\n",
    "event: message_stop\r\n",
    "data: {\"type\":\"message_stop\"}\r\n\r\n",
);

const ANTHROPIC_SSE_USAGE: Usage = Usage {
    input: 925,
    output: 42,
    cache_read: 800,
    cache_write: 100,
};

const RESPONSES_SSE: &str = concat!(
    "event: response.created\n",
    "data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n\n",
    "event: response.output_text.delta\n",
    "data: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"m\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
    "event: error\n",
    "data: {\"type\":\"error\",\"code\":\"x\",\"message\":\"not a \\\"usage\\\" object\",\"param\":null}\n\n",
    "event: response.completed\n",
    "data: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"output\":[],\"usage\":{\"input_tokens\":3000,\"input_tokens_details\":{\"cached_tokens\":2048},\"output_tokens\":77,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":3077}}}\n\n",
);

const RESPONSES_SSE_USAGE: Usage = Usage {
    input: 3000,
    output: 77,
    cache_read: 2048,
    cache_write: 0,
};

/// Gemini, non-streaming: `usageMetadata` after the candidates, a decoy in the text.
const GEMINI_JSON: &str = r#"{"candidates":[{"content":{"parts":[{"text":"the \"usageMetadata\": {\"promptTokenCount\": 1}"}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":8000,"candidatesTokenCount":300,"totalTokenCount":8400,"cachedContentTokenCount":6000,"promptTokensDetails":[{"modality":"TEXT","tokenCount":8000}],"thoughtsTokenCount":100},"modelVersion":"gemini-2.5-flash","responseId":"r1"}"#;

const GEMINI_USAGE: Usage = Usage {
    input: 8000,
    output: 400,
    cache_read: 6000,
    cache_write: 0,
};

/// Gemini streaming (`alt=sse`): every chunk carries the usage so far; the last one counts.
const GEMINI_SSE: &str = concat!(
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"thinking\",\"thought\": true}],\"role\": \"model\"},\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 5000,\"totalTokenCount\": 5000,\"thoughtsTokenCount\": 20}}\r\n\r\n",
    "data: {\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"done\"}],\"role\": \"model\"},\"finishReason\": \"STOP\",\"index\": 0}],\"usageMetadata\": {\"promptTokenCount\": 5000,\"candidatesTokenCount\": 42,\"totalTokenCount\": 5062,\"cachedContentTokenCount\": 4096,\"thoughtsTokenCount\": 20},\"modelVersion\": \"gemini-2.5-flash\"}\r\n\r\n",
);

const GEMINI_SSE_USAGE: Usage = Usage {
    input: 5000,
    output: 62,
    cache_read: 4096,
    cache_write: 0,
};

pub(super) fn samples() -> [(&'static str, Format, &'static str, Usage); 8] {
    [
        ("chat json", Format::Json, CHAT_JSON, CHAT_USAGE),
        (
            "anthropic json",
            Format::Json,
            ANTHROPIC_JSON,
            ANTHROPIC_USAGE,
        ),
        (
            "responses json",
            Format::Json,
            RESPONSES_JSON,
            RESPONSES_USAGE,
        ),
        ("chat sse", Format::Sse, CHAT_SSE, CHAT_SSE_USAGE),
        (
            "anthropic sse",
            Format::Sse,
            ANTHROPIC_SSE,
            ANTHROPIC_SSE_USAGE,
        ),
        (
            "responses sse",
            Format::Sse,
            RESPONSES_SSE,
            RESPONSES_SSE_USAGE,
        ),
        ("gemini json", Format::Json, GEMINI_JSON, GEMINI_USAGE),
        ("gemini sse", Format::Sse, GEMINI_SSE, GEMINI_SSE_USAGE),
    ]
}

fn scan<'a>(format: Format, chunks: impl IntoIterator<Item = &'a [u8]>) -> Option<Usage> {
    let mut s = Scanner::new(format);
    for chunk in chunks {
        s.feed(chunk);
    }
    s.finish()
}

#[test]
fn every_format_in_one_piece() {
    for (name, format, body, expected) in samples() {
        assert_eq!(scan(format, [body.as_bytes()]), Some(expected), "{name}");
    }
}

#[test]
fn every_format_split_at_every_byte_boundary() {
    for (name, format, body, expected) in samples() {
        let bytes = body.as_bytes();
        for i in 0..=bytes.len() {
            let (a, b) = bytes.split_at(i);
            assert_eq!(scan(format, [a, b]), Some(expected), "{name} split at {i}");
        }
        let singles = bytes.chunks(1);
        assert_eq!(scan(format, singles), Some(expected), "{name} byte by byte");
        for size in [2, 3, 7, 64] {
            assert_eq!(
                scan(format, bytes.chunks(size)),
                Some(expected),
                "{name} in chunks of {size}"
            );
        }
    }
}

/// Compresses `body` as a provider would for `Accept-Encoding: gzip` / `deflate`.
pub(super) fn compress(body: &[u8], encoding: Encoding) -> Vec<u8> {
    use std::io::Write;
    let level = flate2::Compression::default();
    match encoding {
        Encoding::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
            e.write_all(body).expect("compress");
            e.finish().expect("compress")
        }
        Encoding::Deflate => {
            let mut e = flate2::write::ZlibEncoder::new(Vec::new(), level);
            e.write_all(body).expect("compress");
            e.finish().expect("compress")
        }
        Encoding::Identity => body.to_vec(),
    }
}

#[tokio::test]
async fn compressed_bodies_pass_unchanged_and_their_usage_is_read() {
    for encoding in [Encoding::Gzip, Encoding::Deflate] {
        for (name, format, body, expected) in samples() {
            let wire = compress(body.as_bytes(), encoding);
            let chunks: VecDeque<Bytes> = wire.chunks(7).map(Bytes::copy_from_slice).collect();
            let (calls, on_done) = callback();
            let observed = Observed::new(Frames(chunks), Some(format), on_done).encoded(encoding);
            let out = observed.collect().await.expect("body").to_bytes();
            assert_eq!(
                out.as_ref(),
                wire.as_slice(),
                "{name}: bytes pass unchanged"
            );
            assert_eq!(
                calls_of(&calls),
                vec![Some(expected)],
                "{name} {encoding:?}"
            );
        }
    }
}

/// A compressed body expanding past its allowance (a compression bomb) is decompressed no
/// further: its usage is given up after a bounded amount of work, and the body still passes
/// through unchanged. The same bytes without the bomb's ratio are read to their usage.
#[tokio::test]
async fn a_compressed_body_expands_only_so_far_before_its_usage_is_given_up() {
    use std::io::Write;
    let usage = br#"],"usage":{"prompt_tokens":5,"completion_tokens":1}}"#;
    const EXPANDED: usize = 64 << 20;
    let bomb = {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(br#"{"pad":["#).expect("compress");
        let zeros = vec![b'0'; 1 << 20];
        for _ in 0..EXPANDED >> 20 {
            e.write_all(&zeros).expect("compress");
        }
        e.write_all(usage).expect("compress");
        e.finish().expect("compress")
    };
    assert!(
        EXPANDED > EXPANSION_FLOOR + bomb.len() * EXPANSION_LIMIT,
        "expands past its allowance: {} bytes compressed",
        bomb.len()
    );

    let mut feed = Feed::Plain(Box::new(Scanner::new(Format::Json)));
    feed = match feed {
        Feed::Plain(s) => Feed::Gzip(Box::new(flate2::write::GzDecoder::new(Sink::new(*s)))),
        other => other,
    };
    let mut stopped_at = None;
    for (i, chunk) in bomb.chunks(1024).enumerate() {
        if !feed.feed(chunk) {
            stopped_at = Some(i);
            break;
        }
    }
    let Feed::Gzip(decoder) = &feed else {
        unreachable!("built above")
    };
    let sink = decoder.get_ref();
    assert!(stopped_at.is_some(), "decompression stopped");
    assert!(
        sink.written <= EXPANSION_FLOOR + sink.received * EXPANSION_LIMIT + 64 * 1024,
        "decompressed {} bytes of {} received",
        sink.written,
        sink.received
    );
    assert_eq!(feed.finish(), None, "usage given up");

    // Through a body: passed on whole, usage None.
    let chunks: VecDeque<Bytes> = bomb.chunks(4096).map(Bytes::copy_from_slice).collect();
    let (calls, on_done) = callback();
    let observed =
        Observed::new(Frames(chunks), Some(Format::Json), on_done).encoded(Encoding::Gzip);
    let out = observed.collect().await.expect("body").to_bytes();
    assert_eq!(out.as_ref(), bomb.as_slice(), "the body passes unchanged");
    assert_eq!(calls_of(&calls), vec![None]);

    // A body of ordinary ratio (under the floor) is read to the end.
    let mut small = br#"{"pad":["#.to_vec();
    small.extend(std::iter::repeat_n(b'0', 1 << 20));
    small.extend_from_slice(usage);
    let wire = compress(&small, Encoding::Gzip);
    let chunks: VecDeque<Bytes> = wire.chunks(4096).map(Bytes::copy_from_slice).collect();
    let (calls, on_done) = callback();
    let observed =
        Observed::new(Frames(chunks), Some(Format::Json), on_done).encoded(Encoding::Gzip);
    observed.collect().await.expect("body");
    assert_eq!(
        calls_of(&calls),
        vec![Some(Usage {
            input: 5,
            output: 1,
            ..Usage::default()
        })]
    );
}

#[test]
fn sse_without_a_final_blank_line_still_counts() {
    let body = ANTHROPIC_SSE.trim_end();
    assert_eq!(
        scan(Format::Sse, [body.as_bytes()]),
        Some(ANTHROPIC_SSE_USAGE)
    );
    let body = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2}}";
    assert_eq!(
        scan(Format::Sse, [body.as_bytes()]),
        Some(Usage {
            input: 40,
            output: 2,
            ..Usage::default()
        })
    );
}

/// A data line over the limit spoils its event however the stream is cut: whole, it was
/// refused when read; cut inside it, it was dropped and the event's other data line parsed
/// alone (found while writing `usage::fuzz`, whose inputs are too short to reach the limit).
#[test]
fn an_over_long_data_line_spoils_its_event_in_any_chunks() {
    let long = "x".repeat(SSE_LINE_LIMIT + 10);
    let body = format!("data: {{\"usage\":{{\"prompt_tokens\":5}}}}\ndata: {long}\n\n");
    let b = body.as_bytes();
    assert_eq!(scan(Format::Sse, [b]), None);
    for at in [34, 37, 40, 100, SSE_LINE_LIMIT, b.len() - 2] {
        let (x, y) = b.split_at(at);
        assert_eq!(scan(Format::Sse, [x, y]), None, "cut at {at}");
    }
    // A data line just within the limits is kept, whole or cut.
    let pad = "x".repeat(SSE_LINE_LIMIT - 64);
    let fits = format!("data: {{\"usage\":{{\"prompt_tokens\":5}},\ndata: \"p\":\"{pad}\"}}\n\n");
    let f = fits.as_bytes();
    let usage = scan(Format::Sse, [f]);
    assert_eq!(usage.map(|u| u.input), Some(5));
    assert_eq!(scan(Format::Sse, [&f[..50], &f[50..]]), usage);
}

#[test]
fn multi_line_sse_data_is_joined() {
    let body = "event: message_delta\ndata: {\"type\":\"message_delta\",\ndata:  \"usage\": {\"input_tokens\": 9, \"output_tokens\": 4}}\n\n";
    assert_eq!(
        scan(Format::Sse, [body.as_bytes()]),
        Some(Usage {
            input: 9,
            output: 4,
            ..Usage::default()
        })
    );
}

#[test]
fn bodies_without_usage_give_none() {
    let cases: [(Format, &str); 8] = [
        (
            Format::Json,
            r#"{"error":{"message":"bad \"usage\"","type":"invalid_request_error"}}"#,
        ),
        (Format::Json, r#"{"usage":null}"#),
        (Format::Json, r#"{"usage":"many"}"#),
        (Format::Json, r#"[{"usage":{"prompt_tokens":1}}]"#),
        (Format::Json, r#"{"a":{"usage":{"prompt_tokens":1}}}"#),
        (Format::Json, "not json at all"),
        (
            Format::Sse,
            "data: {\"choices\":[],\"usage\":null}\n\ndata: [DONE]\n\n",
        ),
        (
            Format::Sse,
            "event: error\ndata: {\"type\":\"error\",\"message\":\"usage\"}\n\n",
        ),
    ];
    for (format, body) in cases {
        assert_eq!(scan(format, [body.as_bytes()]), None, "{body}");
    }
}

#[test]
fn a_truncated_json_body_keeps_a_completed_usage_only() {
    // The usage value is complete when the body stops mid-field: still not trusted, because
    // the value's end (`,` or `}`) was never seen.
    let cut = &CHAT_JSON[..CHAT_JSON.find("\"system_fingerprint\"").expect("field") - 1];
    assert_eq!(scan(Format::Json, [cut.as_bytes()]), None);
    let cut = &CHAT_JSON[..CHAT_JSON.find("\"system_fingerprint\"").expect("field")];
    assert_eq!(scan(Format::Json, [cut.as_bytes()]), Some(CHAT_USAGE));
}

#[test]
fn normalisation_makes_input_comparable_across_providers() {
    // Anthropic without cache fields: input_tokens is everything.
    let body = r#"{"type":"message","usage":{"input_tokens":70,"output_tokens":3}}"#;
    assert_eq!(
        scan(Format::Json, [body.as_bytes()]),
        Some(Usage {
            input: 70,
            output: 3,
            ..Usage::default()
        })
    );
    // message_delta overrides message_start field by field (newer API versions repeat the
    // input counts there).
    let body = concat!(
        "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"cache_read_input_tokens\":5,\"output_tokens\":1}}}\n\n",
        "data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":11,\"cache_read_input_tokens\":5,\"cache_creation_input_tokens\":2,\"output_tokens\":30}}\n\n",
    );
    assert_eq!(
        scan(Format::Sse, [body.as_bytes()]),
        Some(Usage {
            input: 18,
            output: 30,
            cache_read: 5,
            cache_write: 2,
        })
    );
}

#[test]
fn format_from_headers() {
    let headers = |pairs: &[(&'static str, &'static str)]| {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    };
    let ct = "content-type";
    assert_eq!(
        Format::from_headers(&headers(&[(ct, "application/json")])),
        Some(Format::Json)
    );
    assert_eq!(
        Format::from_headers(&headers(&[(ct, "Application/JSON; charset=utf-8")])),
        Some(Format::Json)
    );
    assert_eq!(
        Format::from_headers(&headers(&[(ct, "application/problem+json")])),
        Some(Format::Json)
    );
    assert_eq!(
        Format::from_headers(&headers(&[(ct, "text/event-stream; charset=utf-8")])),
        Some(Format::Sse)
    );
    assert_eq!(
        Format::from_headers(&headers(&[
            (ct, "text/event-stream"),
            ("content-encoding", "identity")
        ])),
        Some(Format::Sse)
    );
    assert_eq!(
        Format::from_headers(&headers(&[
            (ct, "application/json"),
            ("content-encoding", "gzip")
        ])),
        Some(Format::Json)
    );
    let enc = |v: &'static str| Encoding::from_headers(&headers(&[("content-encoding", v)]));
    assert_eq!(
        Encoding::from_headers(&headers(&[])),
        Some(Encoding::Identity)
    );
    assert_eq!(enc("gzip"), Some(Encoding::Gzip));
    assert_eq!(enc("deflate"), Some(Encoding::Deflate));
    assert_eq!(enc("br"), None);
    assert_eq!(Format::from_headers(&headers(&[(ct, "text/plain")])), None);
    assert_eq!(Format::from_headers(&headers(&[])), None);
}

// ---- bounded memory ----

const TEN_MB: usize = 10 * 1024 * 1024;

/// Feeds `total` bytes produced by `next_chunk` and asserts the scanner never holds more than
/// `bound` bytes.
fn assert_bounded(
    format: Format,
    total: usize,
    bound: usize,
    mut next_chunk: impl FnMut(usize) -> Vec<u8>,
) -> Scanner {
    let mut s = Scanner::new(format);
    let mut fed = 0;
    let mut max = 0;
    while fed < total {
        let chunk = next_chunk(fed);
        fed += chunk.len();
        s.feed(&chunk);
        max = max.max(s.retained());
    }
    assert!(max <= bound, "scanner held {max} bytes (bound {bound})");
    s
}

#[test]
fn json_scan_memory_is_bounded_on_ten_megabytes_without_usage() {
    // One huge string value.
    let mut started = false;
    let s = assert_bounded(Format::Json, TEN_MB, 0, |_| {
        let mut chunk = Vec::new();
        if !started {
            chunk.extend_from_slice(br#"{"choices":[{"message":{"content":""#);
            started = true;
        }
        chunk.extend_from_slice(&[b'x'; 64 * 1024]);
        chunk
    });
    assert_eq!(s.finish(), None);

    // A huge structure of numbers and objects.
    let mut started = false;
    let s = assert_bounded(Format::Json, TEN_MB, 0, |_| {
        let mut chunk = Vec::new();
        if !started {
            chunk.extend_from_slice(br#"{"data":["#);
            started = true;
        }
        for _ in 0..1000 {
            chunk.extend_from_slice(br#"{"embedding":[0.1,-0.2,3e5],"i":7},"#);
        }
        chunk
    });
    assert_eq!(s.finish(), None);
}

#[test]
fn json_scan_gives_up_on_an_oversized_usage_value() {
    let mut started = false;
    let mut s = assert_bounded(Format::Json, TEN_MB, 2 * JSON_CAPTURE_LIMIT, |_| {
        let mut chunk = Vec::new();
        if !started {
            chunk.extend_from_slice(br#"{"usage":{"junk":["#);
            started = true;
        }
        for _ in 0..4096 {
            chunk.extend_from_slice(b"12345678,");
        }
        chunk
    });
    s.feed(br#"0]},"x":1,"usage":{"prompt_tokens":5}}"#);
    // Gave up for good: memory was released and nothing later is trusted.
    assert_eq!(s.retained(), 0);
    assert_eq!(s.finish(), None);
}

#[test]
fn sse_scan_memory_is_bounded_on_ten_megabytes_without_usage() {
    // Many ordinary events.
    let event = "data: {\"choices\":[{\"delta\":{\"content\":\"some text here\"}}]}\n\n";
    let s = assert_bounded(Format::Sse, TEN_MB, 2 * KEEP_CAPACITY, |_| {
        event.repeat(1000).into_bytes()
    });
    assert_eq!(s.finish(), None);

    // One endless line: skipped past the limit, and the stream is read on afterwards.
    let mut s = assert_bounded(Format::Sse, TEN_MB, 2 * SSE_LINE_LIMIT, |fed| {
        let mut chunk = Vec::new();
        if fed == 0 {
            chunk.extend_from_slice(b"data: {\"usage\":{\"prompt_tokens\":1},\"x\":\"");
        }
        chunk.extend_from_slice(&[b'y'; 100 * 1024]);
        chunk
    });
    assert_eq!(s.retained(), 0, "the oversized line was released");
    s.feed(b"\"}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"completion_tokens\":8}}\n\n");
    assert_eq!(
        s.finish(),
        Some(Usage {
            input: 64,
            output: 8,
            ..Usage::default()
        })
    );

    // One endless event of many data lines.
    let s = assert_bounded(
        Format::Sse,
        TEN_MB,
        2 * SSE_LINE_LIMIT + KEEP_CAPACITY,
        |_| {
            "data: [1,2,3,4,5,6,7,8,9,\"usage\"]\n"
                .repeat(1000)
                .into_bytes()
        },
    );
    assert_eq!(s.finish(), None);
}

// ---- the body wrapper ----

/// A body fed from a channel, one data frame per message.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// A body of fixed frames.
pub(super) struct Frames(pub(super) VecDeque<Bytes>);

impl Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

pub(super) type Calls = Arc<Mutex<Vec<Option<Usage>>>>;

pub(super) fn callback() -> (Calls, OnUsage) {
    let calls: Calls = Arc::default();
    let sink = calls.clone();
    (
        calls,
        Box::new(move |usage| sink.lock().expect("calls").push(usage)),
    )
}

pub(super) fn calls_of(calls: &Calls) -> Vec<Option<Usage>> {
    calls.lock().expect("calls").clone()
}

/// Polls once: the frame if one is ready, `None` when the body is pending.
async fn poll_once<B: Body<Data = Bytes> + Unpin>(
    body: &mut Observed<B>,
) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
    poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await
}

#[tokio::test]
async fn each_frame_is_yielded_unchanged_before_the_next_is_polled() {
    let (tx, rx) = mpsc::channel(4);
    let (calls, on_done) = callback();
    let mut body = Observed::new(ChannelBody(rx), Some(Format::Sse), on_done);

    // Nothing sent yet: pending, not waiting to fill a buffer.
    assert!(poll_once(&mut body).await.is_pending());

    let bytes = ANTHROPIC_SSE.as_bytes();
    let pieces: Vec<Bytes> = bytes.chunks(37).map(Bytes::copy_from_slice).collect();
    for piece in &pieces {
        tx.send(piece.clone()).await.expect("send");
        let frame = match poll_once(&mut body).await {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => panic!("expected a frame right away, got {:?}", other.map(|_| ())),
        };
        let data = frame.into_data().expect("data frame");
        assert_eq!(data, *piece);
        // The very same buffer, not a copy.
        assert_eq!(data.as_ptr(), piece.as_ptr());
        // And nothing more is held back.
        assert!(poll_once(&mut body).await.is_pending());
    }
    assert!(calls_of(&calls).is_empty(), "the body has not ended yet");
    drop(tx);
    assert!(matches!(poll_once(&mut body).await, Poll::Ready(None)));
    assert_eq!(calls_of(&calls), vec![Some(ANTHROPIC_SSE_USAGE)]);
    drop(body);
    assert_eq!(calls_of(&calls).len(), 1, "exactly once");
}

#[tokio::test]
async fn the_whole_body_passes_through_byte_identical() {
    for (name, format, text, expected) in samples() {
        let frames = text
            .as_bytes()
            .chunks(5)
            .map(Bytes::copy_from_slice)
            .collect();
        let (calls, on_done) = callback();
        let body = Observed::new(Frames(frames), Some(format), on_done);
        let out = body.collect().await.expect("collect").to_bytes();
        assert_eq!(out, text.as_bytes(), "{name}");
        assert_eq!(calls_of(&calls), vec![Some(expected)], "{name}");
    }
}

#[tokio::test]
async fn callback_runs_exactly_once_when_dropped_mid_stream() {
    let (tx, rx) = mpsc::channel(4);
    let (calls, on_done) = callback();
    let mut body = Observed::new(ChannelBody(rx), Some(Format::Sse), on_done);
    // Only the message_start event arrives before the client goes away.
    let start = ANTHROPIC_SSE
        .find("event: content_block_start")
        .expect("event");
    tx.send(Bytes::from_static(&ANTHROPIC_SSE.as_bytes()[..start]))
        .await
        .expect("send");
    assert!(poll_once(&mut body).await.is_ready());
    drop(body);
    assert_eq!(
        calls_of(&calls),
        vec![Some(Usage {
            input: 925,
            output: 1,
            cache_read: 800,
            cache_write: 100,
        })]
    );

    // Dropped before any frame, and without a format: still exactly once, with None.
    let (_tx, rx) = mpsc::channel::<Bytes>(1);
    let (calls, on_done) = callback();
    drop(Observed::new(ChannelBody(rx), Some(Format::Json), on_done));
    assert_eq!(calls_of(&calls), vec![None]);
    let (calls, on_done) = callback();
    let body = Observed::new(
        Frames(VecDeque::from([Bytes::from(CHAT_JSON)])),
        None,
        on_done,
    );
    let out = body.collect().await.expect("collect").to_bytes();
    assert_eq!(out, CHAT_JSON.as_bytes());
    assert_eq!(calls_of(&calls), vec![None]);
}

#[test]
fn record_feeds_metrics_and_calibration() {
    let metrics = Arc::new(Metrics::new().expect("metrics"));
    let calibration = Arc::new(Calibration::new());
    let usage = Usage {
        input: 1000,
        output: 50,
        cache_read: 600,
        cache_write: 100,
    };
    record(&metrics, &calibration, Some("gpt-4o"), Some(800), &usage);
    // No estimate: usage counted, no calibration.
    record(&metrics, &calibration, Some("other"), None, &usage);

    let text = metrics.render();
    for (kind, n) in [
        ("input", 2000),
        ("output", 100),
        ("cache_read", 1200),
        ("cache_write", 200),
    ] {
        let line = format!("compactor_upstream_usage_tokens_total{{kind=\"{kind}\"}} {n}\n");
        assert!(text.contains(&line), "{line}");
    }
    assert!(
        text.contains("compactor_estimate_error_ratio_count 1\n"),
        "{text}"
    );
    assert!(
        text.contains("compactor_estimate_error_ratio_sum -0.2\n"),
        "{text}"
    );
    assert!((calibration.factor("gpt-4o") - 1.25).abs() < 1e-9);
    assert_eq!(calibration.factor("other"), 1.0);
}

#[test]
fn callback_counter_type_is_send() {
    fn is_send<T: Send>(_: &T) {}
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let body = Observed::new(
        Frames(VecDeque::new()),
        Some(Format::Json),
        Box::new(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        }),
    );
    is_send(&body);
    drop(body);
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[test]
fn only_events_that_may_hold_a_usage_are_parsed() {
    // With `include_usage`, every chunk before the last carries `"usage":null`: not parsed.
    for data in [
        r#"{"choices":[{"delta":{"content":"hi"}}],"usage":null}"#,
        r#"{"choices":[],"usage" :  null}"#,
        r#"{"choices":[{"delta":{"content":"say \"usage\": {}"}}]}"#,
        r#"{"type":"ping"}"#,
    ] {
        assert!(!names_usage(data.as_bytes()), "{data}");
    }
    for data in [
        r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
        r#"{"type":"message_start","message":{"usage": {"input_tokens":1}}}"#,
        r#"{"usage":null,"response":{"usage":{"input_tokens":1}}}"#,
        r#"{"kind":"usage"}"#,
    ] {
        assert!(names_usage(data.as_bytes()), "{data}");
    }
    // A stream of null usages and a last real one reads the last.
    let mut stream = String::new();
    for i in 0..50 {
        stream.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}],\"usage\":null}}\n\n"
        ));
    }
    stream.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":50}}\n\ndata: [DONE]\n\n");
    assert_eq!(
        scan(Format::Sse, [stream.as_bytes()]),
        Some(Usage {
            input: 40,
            output: 50,
            cache_read: 0,
            cache_write: 0,
        })
    );
}
