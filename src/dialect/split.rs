//! The structural pass of a scan: a JSON body split into its top-level fields and a
//! conversation array into its elements, as slices of the body, without decoding anything.
//!
//! A chat body is mostly strings (message text, tool output). serde_json skipping them to
//! capture raw values checks every byte twice and stops at every escape; this pass finds string
//! ends a word at a time and tracks nesting only between strings, so it costs a fraction of a
//! decoding pass. It does not validate what it skips: every message is then read by its
//! dialect's counter (by hand for the common shapes, by serde_json for anything else; either
//! rejects what is not JSON), and the top-level fields the scan reads are decoded one by one.
//! A field nobody reads is forwarded as the client sent it, so an error in it reaches the
//! provider exactly as it would have without compactor.
//! Malformed structure is an error, never a panic or a slice out of bounds.

use std::borrow::Cow;

use super::DialectError;
pub(crate) use crate::estimate::quote_or_backslash;

/// One top-level field: its key (unescaped) and its value as sent.
#[derive(Debug)]
pub(crate) struct Field<'a> {
    pub key: Cow<'a, str>,
    pub value: &'a str,
}

/// The top-level fields of a JSON object, in order. The value of the field named
/// `conversation` (a chat body's bulk) is not skipped but handed to `read_conversation` with
/// the rest of the body from its first byte; it answers how many bytes the value took, so
/// that value is read exactly once.
pub(crate) fn object_fields<'a>(
    body: &'a str,
    conversation: &str,
    mut read_conversation: impl FnMut(&'a str) -> Result<usize, DialectError>,
) -> Result<Vec<Field<'a>>, DialectError> {
    let b = body.as_bytes();
    let mut i = skip_ws(b, 0);
    expect(b, i, b'{')?;
    i = skip_ws(b, i + 1);
    let mut fields = Vec::with_capacity(16);
    if b.get(i) == Some(&b'}') {
        return end(b, i + 1).map(|()| fields);
    }
    loop {
        expect(b, i, b'"')?;
        let key_end = skip_string(b, i)?;
        let key = key_text(body, i, key_end)?;
        i = skip_ws(b, key_end);
        expect(b, i, b':')?;
        let start = skip_ws(b, i + 1);
        let value_end = if key == conversation {
            let rest = body.get(start..).ok_or_else(|| malformed(start))?;
            start.saturating_add(read_conversation(rest)?)
        } else {
            skip_value(b, start)?
        };
        fields.push(Field {
            key,
            value: slice(body, start, value_end)?,
        });
        i = skip_ws(b, value_end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return end(b, i + 1).map(|()| fields),
            _ => return Err(malformed(i)),
        }
    }
}

/// Reads the array at the start of `text` element by element, each decoded as `T` in place
/// (a dialect's counter), collecting each element's slice and value: the array is read once.
/// Answers them and the bytes the array took; a `null` is no array (`None`).
#[allow(clippy::type_complexity)]
pub(crate) fn read_array<'a, T: serde::Deserialize<'a>>(
    text: &'a str,
) -> Result<(Option<(Vec<&'a str>, Vec<T>)>, usize), DialectError> {
    read_array_with(text, |_| None)
}

/// [`read_array`] with a faster reader for the common shape of element: `fast` answers an
/// element's value and length, or `None` to leave it to serde, which then reads the element
/// from its start (so whatever `fast` refuses, every error included, is serde's to answer).
#[allow(clippy::type_complexity)]
pub(crate) fn read_array_with<'a, T: serde::Deserialize<'a>>(
    text: &'a str,
    fast: impl FnMut(&'a str) -> Option<(T, usize)>,
) -> Result<(Option<(Vec<&'a str>, Vec<T>)>, usize), DialectError> {
    read_array_after::<T, T>(text, fast, None)
}

/// The bytes an element of a read array is first assumed to take, to size its vectors: about
/// a short chat message (an agent's, carrying tool output, take more; then this is room to
/// spare, a few bytes for every 512 of the body).
const BYTES_PER_ELEMENT: usize = 512;

/// Leading elements of an array already read: their slices and values, and where the last
/// ends (from the array's `[`).
pub(crate) type Read<'a, V> = (Vec<&'a str>, Vec<V>, usize);

/// [`read_array_with`], each element's value kept as a `V` (serde's `T` converted), after the
/// elements `known` says were read already (`None`: from the start). Those are trusted as they
/// are: the caller vouches that `text` holds them, byte for byte, where they say.
#[allow(clippy::type_complexity)]
pub(crate) fn read_array_after<'a, T: serde::Deserialize<'a> + Into<V>, V>(
    text: &'a str,
    mut fast: impl FnMut(&'a str) -> Option<(V, usize)>,
    known: Option<Read<'a, V>>,
) -> Result<(Option<(Vec<&'a str>, Vec<V>)>, usize), DialectError> {
    let b = text.as_bytes();
    if b.starts_with(b"null") {
        return Ok((None, 4));
    }
    expect(b, 0, b'[')?;
    let (mut elements, mut values, mut i) = match known {
        Some((elements, values, end)) if !elements.is_empty() => {
            // Right after an element: a delimiter.
            match next(b, skip_ws(b, end))? {
                Next::Element(i) => (elements, values, i),
                Next::End(len) => return Ok((Some((elements, values)), len)),
            }
        }
        _ => {
            let i = skip_ws(b, 1);
            if b.get(i) == Some(&b']') {
                return Ok((Some((Vec::new(), Vec::new())), i + 1));
            }
            // Room for an element every `BYTES_PER_ELEMENT` bytes: from 64, the vectors of
            // a 769-message request were copied into larger ones four times each.
            let room = (b.len() / BYTES_PER_ELEMENT).clamp(64, 1 << 16);
            (Vec::with_capacity(room), Vec::with_capacity(room), i)
        }
    };
    loop {
        let rest = text.get(i..).ok_or_else(|| malformed(i))?;
        let len = match fast(rest) {
            Some((value, len)) => {
                values.push(value);
                len
            }
            None => {
                let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<T>();
                values.push(stream.next().ok_or_else(|| malformed(i))??.into());
                // The stream stops right after the element: it looks no further than a
                // delimiter.
                stream.byte_offset()
            }
        };
        elements.push(slice(text, i, i + len)?);
        match next(b, skip_ws(b, i + len))? {
            Next::Element(next) => i = next,
            Next::End(len) => return Ok((Some((elements, values)), len)),
        }
    }
}

/// What follows an array element.
enum Next {
    /// Another element, starting here.
    Element(usize),
    /// The array's end: the bytes it took.
    End(usize),
}

/// The delimiter at `i`, after an element.
fn next(b: &[u8], i: usize) -> Result<Next, DialectError> {
    match b.get(i) {
        Some(b',') => Ok(Next::Element(skip_ws(b, i + 1))),
        Some(b']') => Ok(Next::End(i + 1)),
        _ => Err(malformed(i)),
    }
}

/// The field named `name`: `None` when absent; a repeated field is an error (which of the two
/// a provider reads is not compactor's guess to make).
pub(crate) fn field<'a>(fields: &[Field<'a>], name: &str) -> Result<Option<&'a str>, DialectError> {
    let mut found = fields.iter().filter(|f| f.key == name);
    match (found.next(), found.next()) {
        (Some(f), None) => Ok(Some(f.value)),
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err(DialectError::Repeated(name.to_string())),
    }
}

/// The field named `name` unless absent or `null` (serde's `Option` reads both as `None`).
pub(crate) fn present<'a>(
    fields: &[Field<'a>],
    name: &str,
) -> Result<Option<&'a str>, DialectError> {
    Ok(field(fields, name)?.filter(|v| *v != "null"))
}

/// The field named `name` decoded as `T` (`None` when absent or `null`).
pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    fields: &[Field<'_>],
    name: &str,
) -> Result<Option<T>, DialectError> {
    present(fields, name)?
        .map(serde_json::from_str)
        .transpose()
        .map_err(DialectError::from)
}

/// The JSON value at the start of `text` decoded as `T`, and the bytes it takes; `None` when it
/// is not one (what serde would say is the caller's to find out).
pub(crate) fn value<'a, T: serde::Deserialize<'a>>(text: &'a str) -> Option<(T, usize)> {
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<T>();
    let value = stream.next()?.ok()?;
    Some((value, stream.byte_offset()))
}

/// How many bytes the JSON value at the start of `text` takes (not validated).
pub(crate) fn value_len(text: &str) -> Result<usize, DialectError> {
    skip_value(text.as_bytes(), 0)
}

fn malformed(at: usize) -> DialectError {
    DialectError::Malformed { at }
}

fn slice(text: &str, start: usize, end: usize) -> Result<&str, DialectError> {
    // Every boundary this module finds is at an ASCII byte, hence a character boundary.
    text.get(start..end).ok_or_else(|| malformed(start))
}

fn key_text(body: &str, start: usize, end: usize) -> Result<Cow<'_, str>, DialectError> {
    let token = slice(body, start, end)?;
    let inner = &token[1..token.len() - 1];
    if inner.contains('\\') {
        Ok(Cow::Owned(serde_json::from_str::<String>(token)?))
    } else {
        Ok(Cow::Borrowed(inner))
    }
}

fn expect(b: &[u8], i: usize, want: u8) -> Result<(), DialectError> {
    if b.get(i) == Some(&want) {
        Ok(())
    } else {
        Err(malformed(i))
    }
}

/// Only whitespace may follow the value.
fn end(b: &[u8], i: usize) -> Result<(), DialectError> {
    let i = skip_ws(b, i);
    if i == b.len() {
        Ok(())
    } else {
        Err(malformed(i))
    }
}

pub(crate) fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    i
}

/// The end (exclusive) of the string starting at `b[i] == '"'`.
fn skip_string(b: &[u8], start: usize) -> Result<usize, DialectError> {
    let mut i = start + 1;
    loop {
        i += quote_or_backslash(b.get(i..).unwrap_or_default()).ok_or_else(|| malformed(start))?;
        match b[i] {
            b'"' => return Ok(i + 1),
            // A backslash escapes the next byte (`\u` is followed by plain hex digits).
            _ => i += 2,
        }
    }
}

/// The end (exclusive) of the value starting at `b[i]`.
fn skip_value(b: &[u8], i: usize) -> Result<usize, DialectError> {
    match b.get(i) {
        Some(b'"') => skip_string(b, i),
        Some(b'{' | b'[') => skip_nested(b, i),
        Some(_) => {
            // A number or a literal: up to the next delimiter.
            let len = b[i..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t'))
                .unwrap_or(b.len() - i);
            if len == 0 {
                Err(malformed(i))
            } else {
                Ok(i + len)
            }
        }
        None => Err(malformed(i)),
    }
}

/// The end (exclusive) of the object or array starting at `b[i]`: brackets are counted
/// between strings, which are skipped whole.
fn skip_nested(b: &[u8], start: usize) -> Result<usize, DialectError> {
    let mut depth = 0usize;
    let mut i = start;
    while let Some(&c) = b.get(i) {
        match c {
            b'"' => {
                i = skip_string(b, i)?;
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1).ok_or_else(|| malformed(i))?;
                if depth == 0 {
                    return Ok(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    Err(malformed(start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::de::IgnoredAny;
    use serde_json::Value;

    #[test]
    fn splits_fields_and_elements_as_sent() {
        let body = " {\"a\" : [1, {\"x\":\"]}\\\"\"}] ,\"b\\u0063\":\"s\\\\\",\n\"n\":-1.5e3,\"t\":true,\"z\":null} ";
        let mut read = None;
        let fields = object_fields(body, "a", |rest| {
            let (elements, len) = read_array::<IgnoredAny>(rest)?;
            read = elements.map(|(e, _)| e);
            Ok(len)
        })
        .expect("fields");
        let keys: Vec<&str> = fields.iter().map(|f| f.key.as_ref()).collect();
        assert_eq!(keys, ["a", "bc", "n", "t", "z"]);
        assert_eq!(fields[0].value, "[1, {\"x\":\"]}\\\"\"}]");
        assert_eq!(fields[1].value, "\"s\\\\\"");
        assert_eq!(fields[2].value, "-1.5e3");
        assert_eq!(read.expect("elements"), ["1", "{\"x\":\"]}\\\"\"}"]);
        let (empty, len) = read_array::<IgnoredAny>("[ ] ,").expect("empty");
        assert_eq!((empty.map(|(e, _)| e.len()), len), (Some(0), 3));
        assert_eq!(read_array::<IgnoredAny>("null}").expect("null").1, 4);
        assert!(matches!(
            field(
                &object_fields(r#"{"m":1,"m":2}"#, "", |_| Ok(0)).expect("fields"),
                "m"
            ),
            Err(DialectError::Repeated(_))
        ));
    }

    #[test]
    fn quotes_and_backslashes_are_found_at_any_offset() {
        for len in 0..40 {
            for at in 0..len {
                for c in [b'"', b'\\'] {
                    let mut b = vec![b'a'; len];
                    b[at] = c;
                    if at + 1 < len {
                        b[at + 1] = b'"';
                    }
                    assert_eq!(quote_or_backslash(&b), Some(at), "{len} {at}");
                }
            }
            assert_eq!(quote_or_backslash(&vec![0xe9; len]), None);
        }
    }

    #[test]
    fn malformed_structure_is_an_error() {
        for bad in [
            "",
            "{",
            "[",
            "{\"a\"",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":1} x",
            "{\"a\":\"open}",
            "{\"a\":[1,2}",
            "{\"a\":]}",
            "{\"a\":\"\\",
            "{a:1}",
            "[1 2]",
            "{\"a\":1 \"b\":2}",
        ] {
            let split = object_fields(bad, "a", |rest| read_array::<IgnoredAny>(rest).map(|r| r.1));
            assert!(split.is_err(), "{bad:?}");
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z\"\\\\{}\\[\\],:é\u{1} ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec(("[a-c\"\\\\]{0,3}", inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Valid JSON, compact or pretty: the fields and elements are exactly the values serde
        /// reads.
        #[test]
        fn agrees_with_serde(fields in prop::collection::vec(("[a-c]{1,2}", json_value()), 0..6), pretty in any::<bool>()) {
            let object = Value::Object(fields.into_iter().collect());
            let text = if pretty {
                serde_json::to_string_pretty(&object).expect("pretty")
            } else {
                serde_json::to_string(&object).expect("compact")
            };
            let split = object_fields(&text, "", |_| Ok(0)).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let Value::Object(map) = &object else { unreachable!() };
            prop_assert_eq!(split.len(), map.len());
            for f in &split {
                let value: Value = serde_json::from_str(f.value).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(Some(&value), map.get(f.key.as_ref()));
                if let Value::Array(items) = &value {
                    let (read, len) = read_array::<Value>(f.value).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(len, f.value.len());
                    let (elements, values) = read.expect("an array");
                    prop_assert_eq!(&values, items);
                    let parsed: Vec<Value> = elements.iter().map(|e| serde_json::from_str(e).expect("element")).collect();
                    prop_assert_eq!(&parsed, items);
                }
            }
        }
    }
}
