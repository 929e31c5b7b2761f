//! Fuzzing support shared by the parser fuzz tests (`pipeline::fuzz` for the request dialects
//! and the pipeline, `usage::fuzz` for the response usage scanner): how many cases a run
//! makes, and the input strategies (arbitrary bytes, arbitrary JSON, and mutations of
//! real-shaped bodies).
//!
//! Only the stable toolchain is used: these are proptest strategies, not a coverage-guided
//! fuzzer, so the mutations aim at what a parser of these formats gets wrong (truncation at
//! any byte, invalid UTF-8, lone surrogate escapes, numbers out of every integer range,
//! nesting past serde_json's depth limit, values of the wrong type where a field is read).

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence};
use serde_json::{Map, Value};

/// The number of cases of a fuzz property: `COMPACTOR_FUZZ_CASES` (or `PROPTEST_CASES`) when
/// set, else `short`, the count the default `cargo test` runs in CI.
pub(crate) fn cases(short: u32) -> u32 {
    ["COMPACTOR_FUZZ_CASES", "PROPTEST_CASES"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.trim().parse().ok())
        .unwrap_or(short)
}

/// A runner configuration of [`cases`] cases whose failures are saved beside `source_file`
/// (under `proptest-regressions/`) and replayed first on the next run.
pub(crate) fn config(short: u32, source_file: &'static str) -> ProptestConfig {
    ProptestConfig {
        cases: cases(short),
        source_file: Some(source_file),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

/// Arbitrary bytes, about half the time drawn from the bytes JSON and SSE are made of, so
/// the parsers get past their first byte.
pub(crate) fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    const ALPHABET: &[u8] = b"{}[]\":,\\ \n\r\t0123456789.-+eEtrufalsn\x00\xff\xc3\xa9udata:event";
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..max),
        proptest::collection::vec(proptest::sample::select(ALPHABET.to_vec()), 0..max),
    ]
}

/// Keys of the three request dialects and the usage objects, so arbitrary objects often look
/// like what the parsers read.
const KEYS: &[&str] = &[
    "role",
    "content",
    "messages",
    "input",
    "type",
    "text",
    "tool_calls",
    "tool_call_id",
    "function",
    "arguments",
    "name",
    "id",
    "call_id",
    "tool_use_id",
    "output",
    "summary",
    "system",
    "model",
    "max_tokens",
    "max_output_tokens",
    "previous_response_id",
    "usage",
    "prompt_tokens",
    "input_tokens",
    "cache_read_input_tokens",
    "message",
    "response",
];

/// String values the parsers branch on.
const WORDS: &[&str] = &[
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "text",
    "image",
    "image_url",
    "input_text",
    "input_image",
    "tool_use",
    "tool_result",
    "thinking",
    "reasoning",
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "local_shell_call",
    "",
];

/// Arbitrary JSON (bounded depth and size), with the dialects' keys and values likely.
pub(crate) fn json() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        3 => proptest::sample::select(KEYS).prop_map(str::to_string),
        1 => "[a-z_]{0,6}",
        1 => any::<String>(),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        proptest::sample::select(WORDS).prop_map(Value::from),
        "[a-z \"\\\\\n\u{0}\u{1f}é日🦀\u{feff}]{0,24}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 160, 10, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..10).prop_map(Value::from),
            proptest::collection::vec((key.clone(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

/// What a value-level mutation puts in place of a value, as raw JSON text: what
/// `serde_json::Value` cannot hold (numbers beyond `u64`/`i64`/`f64`, lone surrogates) and
/// nesting around serde_json's recursion limit of 128.
fn raw_values() -> Vec<String> {
    let mut raw: Vec<String> = [
        "1e400",
        "-1e400",
        "18446744073709551616",
        "-9223372036854775809",
        "1.7976931348623157e309",
        "1e-400",
        "-0",
        "0.0",
        "1E+2",
        r#""\ud800""#,
        r#""\udc00\ud800""#,
        r#""a\ud800b""#,
        r#""\ud83e\udd80""#,
        r#""\u0000""#,
        r#""\uFFFF""#,
        "\"\u{feff}\"",
        "{}",
        "[]",
        "\"\"",
        "null",
        "true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for depth in [64, 127, 128, 129, 400] {
        raw.push(format!("{}{}", "[".repeat(depth), "]".repeat(depth)));
        raw.push(format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth)));
    }
    raw.push(format!("\"{}\"", "x".repeat(20_000)));
    raw
}

/// Byte sequences a byte-level mutation inserts: a BOM, invalid UTF-8 (a lone continuation
/// byte, a truncated sequence, an encoded surrogate, an overlong encoding), NUL, structural
/// characters and escapes cut in half.
fn raw_bytes() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = vec![
        vec![0xef, 0xbb, 0xbf],
        vec![0xff],
        vec![0x80],
        vec![0xc3],
        vec![0xed, 0xa0, 0x80],
        vec![0xc0, 0xaf],
        vec![0],
        b"\\".to_vec(),
        b"\\u".to_vec(),
        b"\\ud800".to_vec(),
        b"\"".to_vec(),
        b",".to_vec(),
        b"}".to_vec(),
        b"]".to_vec(),
        b"{".to_vec(),
        b"[".to_vec(),
        b":".to_vec(),
        b"\n".to_vec(),
        b"\r\n".to_vec(),
        b"\n\n".to_vec(),
        b"data: ".to_vec(),
        b"\"usage\":".to_vec(),
    ];
    out.extend(raw_values().into_iter().map(String::into_bytes));
    out
}

/// One change to a body.
#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// Flip the bits of `mask` in one byte.
    Flip { at: usize, mask: u8 },
    /// Cut the body at a byte.
    Truncate(usize),
    /// Insert arbitrary bytes.
    Insert { at: usize, bytes: Vec<u8> },
    /// Insert a nasty byte sequence (see [`raw_bytes`]).
    InsertRaw { at: usize, raw: Vec<u8> },
    /// Delete up to `len` bytes.
    Delete { at: usize, len: usize },
    /// Copy up to `len` bytes to another position.
    Duplicate { from: usize, len: usize, to: usize },
    /// A byte order mark before the body.
    Bom,
    /// Bytes after the body.
    Trailing(Vec<u8>),
    /// (JSON) Remove an element of an array.
    DeleteElement { array: usize, element: usize },
    /// (JSON) Repeat an element of an array.
    DuplicateElement { array: usize, element: usize },
    /// (JSON) Swap two elements of an array.
    SwapElements { array: usize, a: usize, b: usize },
    /// (JSON) Replace a value (an object member or array element) with arbitrary JSON.
    Replace { at: usize, with: Value },
    /// (JSON) Change a value's type, keeping what can be kept (a string's length as a
    /// number, a scalar wrapped in an array or an object).
    Retype { at: usize, to: u8 },
    /// (JSON) Replace a value with raw text no `Value` holds (see [`raw_values`]).
    ReplaceRaw { at: usize, raw: String },
    /// (JSON) Re-serialise pretty-printed.
    Pretty,
}

impl Mutation {
    /// Whether this mutation works on the parsed value (and is skipped when the body is no
    /// longer JSON).
    fn is_structural(&self) -> bool {
        matches!(
            self,
            Mutation::DeleteElement { .. }
                | Mutation::DuplicateElement { .. }
                | Mutation::SwapElements { .. }
                | Mutation::Replace { .. }
                | Mutation::Retype { .. }
                | Mutation::ReplaceRaw { .. }
                | Mutation::Pretty
        )
    }
}

/// Any [`Mutation`].
pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
    let index = any::<usize>;
    prop_oneof![
        2 => (index(), 1u8..=255).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        2 => index().prop_map(Mutation::Truncate),
        1 => (index(), proptest::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (index(), proptest::sample::select(raw_bytes()))
            .prop_map(|(at, raw)| Mutation::InsertRaw { at, raw }),
        1 => (index(), 1usize..64).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => (index(), 1usize..256, index())
            .prop_map(|(from, len, to)| Mutation::Duplicate { from, len, to }),
        1 => Just(Mutation::Bom),
        1 => proptest::collection::vec(any::<u8>(), 1..8).prop_map(Mutation::Trailing),
        3 => (index(), index()).prop_map(|(array, element)| Mutation::DeleteElement { array, element }),
        3 => (index(), index()).prop_map(|(array, element)| Mutation::DuplicateElement { array, element }),
        2 => (index(), index(), index()).prop_map(|(array, a, b)| Mutation::SwapElements { array, a, b }),
        4 => (index(), json()).prop_map(|(at, with)| Mutation::Replace { at, with }),
        4 => (index(), any::<u8>()).prop_map(|(at, to)| Mutation::Retype { at, to }),
        3 => (index(), proptest::sample::select(raw_values()))
            .prop_map(|(at, raw)| Mutation::ReplaceRaw { at, raw }),
        1 => Just(Mutation::Pretty),
    ]
}

/// Between `min` and `max` mutations.
pub(crate) fn mutations(min: usize, max: usize) -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), min..=max)
}

/// `body` with `mutations` applied: those on the parsed value first (while the body is still
/// JSON), then those on its bytes, each in order.
pub(crate) fn mutate(body: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = body.to_vec();
    let (structural, bytes): (Vec<&Mutation>, Vec<&Mutation>) =
        mutations.iter().partition(|m| m.is_structural());
    if !structural.is_empty() {
        if let Ok(mut value) = serde_json::from_slice::<Value>(&out) {
            let mut raw = Vec::new();
            let mut pretty = false;
            for m in structural {
                match m {
                    Mutation::Pretty => pretty = true,
                    other => apply_to_value(&mut value, other, &mut raw),
                }
            }
            out = serialise(&value, pretty, &raw);
        }
    }
    for m in bytes {
        apply_to_bytes(&mut out, m);
    }
    out
}

/// The placeholder a [`Mutation::ReplaceRaw`] leaves in the value, replaced by the raw text
/// once serialised (`\u0001` cannot come from the generators' own strings unescaped).
fn placeholder(n: usize) -> String {
    format!("\u{1}fuzz-raw-{n}\u{1}")
}

fn serialise(value: &Value, pretty: bool, raw: &[String]) -> Vec<u8> {
    let text = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    };
    let mut text = text.unwrap_or_default();
    for (n, r) in raw.iter().enumerate() {
        let quoted = serde_json::to_string(&placeholder(n)).unwrap_or_default();
        text = text.replacen(&quoted, r, 1);
    }
    text.into_bytes()
}

fn apply_to_value(value: &mut Value, m: &Mutation, raw: &mut Vec<String>) {
    match m {
        Mutation::DeleteElement { array, element } => {
            if let Some(items) = nth_array(value, *array) {
                items.remove(pick(*element, items.len()));
            }
        }
        Mutation::DuplicateElement { array, element } => {
            if let Some(items) = nth_array(value, *array) {
                let i = pick(*element, items.len());
                let copy = items[i].clone();
                items.insert(i, copy);
            }
        }
        Mutation::SwapElements { array, a, b } => {
            if let Some(items) = nth_array(value, *array) {
                let n = items.len();
                items.swap(pick(*a, n), pick(*b, n));
            }
        }
        Mutation::Replace { at, with } => {
            if let Some(v) = nth_value(value, *at) {
                *v = with.clone();
            }
        }
        Mutation::Retype { at, to } => {
            if let Some(v) = nth_value(value, *at) {
                *v = retyped(v, *to);
            }
        }
        Mutation::ReplaceRaw { at, raw: text } => {
            if let Some(v) = nth_value(value, *at) {
                *v = Value::String(placeholder(raw.len()));
                raw.push(text.clone());
            }
        }
        _ => {}
    }
}

/// `v` as another JSON type.
fn retyped(v: &Value, to: u8) -> Value {
    let len = match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.len(),
        Value::Object(o) => o.len(),
        _ => 1,
    };
    match to % 7 {
        0 => Value::Null,
        1 => Value::from(len),
        2 => Value::from(-(len as i64) - 1),
        3 => Value::from(v.to_string()),
        4 => Value::Array(vec![v.clone()]),
        5 => {
            let mut o = Map::new();
            o.insert("type".into(), v.clone());
            Value::Object(o)
        }
        _ => Value::Bool(len % 2 == 0),
    }
}

fn count_values(v: &Value) -> usize {
    1 + match v {
        Value::Array(items) => items.iter().map(count_values).sum(),
        Value::Object(map) => map.values().map(count_values).sum(),
        _ => 0,
    }
}

/// The `at`-th value in pre-order (the whole document included).
fn nth_value(v: &mut Value, at: usize) -> Option<&mut Value> {
    let mut k = pick(at, count_values(v));
    find_value(v, &mut k)
}

fn find_value<'v>(v: &'v mut Value, k: &mut usize) -> Option<&'v mut Value> {
    if *k == 0 {
        return Some(v);
    }
    *k -= 1;
    match v {
        Value::Array(items) => items.iter_mut().find_map(|item| find_value(item, k)),
        Value::Object(map) => map.values_mut().find_map(|item| find_value(item, k)),
        _ => None,
    }
}

fn count_arrays(v: &Value) -> usize {
    match v {
        Value::Array(items) => {
            usize::from(!items.is_empty()) + items.iter().map(count_arrays).sum::<usize>()
        }
        Value::Object(map) => map.values().map(count_arrays).sum(),
        _ => 0,
    }
}

/// The `at`-th non-empty array in pre-order.
fn nth_array(v: &mut Value, at: usize) -> Option<&mut Vec<Value>> {
    let n = count_arrays(v);
    if n == 0 {
        return None;
    }
    let mut k = pick(at, n);
    find_array(v, &mut k)
}

fn find_array<'v>(v: &'v mut Value, k: &mut usize) -> Option<&'v mut Vec<Value>> {
    match v {
        Value::Array(items) if !items.is_empty() => {
            if *k == 0 {
                return Some(items);
            }
            *k -= 1;
            items.iter_mut().find_map(|item| find_array(item, k))
        }
        Value::Object(map) => map.values_mut().find_map(|item| find_array(item, k)),
        _ => None,
    }
}

fn apply_to_bytes(out: &mut Vec<u8>, m: &Mutation) {
    let len = out.len();
    match m {
        Mutation::Flip { at, mask } if len > 0 => out[pick(*at, len)] ^= mask,
        Mutation::Truncate(at) => out.truncate(pick(*at, len + 1)),
        Mutation::Insert { at, bytes } | Mutation::InsertRaw { at, raw: bytes } => {
            let i = pick(*at, len + 1);
            out.splice(i..i, bytes.iter().copied());
        }
        Mutation::Delete { at, len: n } => {
            let i = pick(*at, len + 1);
            out.drain(i..(i + n).min(len));
        }
        Mutation::Duplicate { from, len: n, to } => {
            let i = pick(*from, len + 1);
            let copy = out[i..(i + n).min(len)].to_vec();
            let j = pick(*to, len + 1);
            out.splice(j..j, copy);
        }
        Mutation::Bom => {
            out.splice(0..0, [0xef, 0xbb, 0xbf]);
        }
        Mutation::Trailing(bytes) => out.extend_from_slice(bytes),
        _ => {}
    }
}

/// A position among `n` picked by `raw` (shrinking `raw` moves it to the first); 0 when
/// there is none.
pub(crate) fn pick(raw: usize, n: usize) -> usize {
    raw.checked_rem(n).unwrap_or(0)
}

/// Splits `bytes` into chunks at the points `cuts` pick (sorted, duplicates make empty
/// chunks), as a network might deliver them.
pub(crate) fn chunks<'b>(bytes: &'b [u8], cuts: &[usize]) -> Vec<&'b [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|&c| pick(c, bytes.len() + 1)).collect();
    at.sort_unstable();
    let mut out = Vec::with_capacity(at.len() + 1);
    let mut start = 0;
    for end in at {
        out.push(&bytes[start..end]);
        start = end;
    }
    out.push(&bytes[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The mutations do what they say: value-level ones keep the body JSON (but raw texts
    /// serde rejects), byte-level ones change the bytes.
    #[test]
    fn mutations_change_bodies_as_described() {
        let body = json!({"a": [1, 2, 3], "b": "x"}).to_string().into_bytes();
        let first = 0;
        let deleted = mutate(
            &body,
            &[Mutation::DeleteElement {
                array: first,
                element: first,
            }],
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&deleted).expect("JSON"),
            json!({"a": [2, 3], "b": "x"})
        );
        let raw = mutate(
            &body,
            &[Mutation::ReplaceRaw {
                at: first,
                raw: "1e400".into(),
            }],
        );
        assert_eq!(raw, b"1e400");
        let cut = mutate(&body, &[Mutation::Truncate(first), Mutation::Bom]);
        assert_eq!(cut, [0xef, 0xbb, 0xbf]);
        assert_eq!(chunks(b"abcd", &[first, first]), [&b""[..], b"", b"abcd"]);
        assert!(raw_values().iter().any(|r| r.starts_with(&"[".repeat(129))));
    }
}
