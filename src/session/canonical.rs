//! Canonical JSON: one byte form per JSON value, so two serialisations of the same message hash
//! alike.
//!
//! Object keys are sorted by their (unescaped) UTF-8 bytes, a repeated key keeps its last value,
//! insignificant whitespace is dropped, and strings and numbers are written as serde_json writes
//! them (so `"\u00e9"` and `"é"`, or `1.0` and `1.00`, come out alike). This runs on every
//! message of every request whose history may match a checkpoint, so it works on the bytes in
//! one pass instead of building a `Value`: a string without escapes and an integer are copied
//! as they are (that is already serde_json's form), and only escaped strings and non-integer
//! numbers go through serde_json. The input must be valid JSON (a `RawValue`, or bytes checked
//! by [`canonical_json`]); anything else is an error, never a panic.

use std::borrow::Cow;

use crate::dialect::split::quote_or_backslash;

/// Canonicalising found bytes that are not JSON.
#[derive(Debug, thiserror::Error)]
pub enum CanonicalError {
    /// Not JSON.
    #[error("message is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Malformed where serde_json did not look (a bug in the caller: unchecked input).
    #[error("message is not valid JSON at byte {0}")]
    Malformed(usize),
    /// Nested deeper than [`MAX_DEPTH`]. Valid JSON, but the writer recurses per level, and a
    /// request must not be able to overflow the stack of the worker reading it.
    #[error("message nests arrays and objects deeper than {MAX_DEPTH} levels")]
    TooDeep,
}

/// Arrays and objects nested deeper than this are refused: serde_json's own limit, so no
/// message compactor can parse is refused here.
pub const MAX_DEPTH: usize = 128;

/// `json` in canonical form. Checks that `json` is JSON first.
pub fn canonical_json(json: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    let raw: &serde_json::value::RawValue = serde_json::from_slice(json)?;
    let mut out = Vec::with_capacity(json.len());
    canonical_into(raw.get(), &mut out)?;
    Ok(out)
}

/// The canonical form of `json` (valid JSON: a `RawValue`'s text) into `out` (cleared first).
pub fn canonical_into(json: &str, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    out.clear();
    // The canonical form is about as long as the text: one allocation, not one per doubling.
    out.reserve(json.len());
    let mut c = Canon {
        text: json,
        s: json.as_bytes(),
        i: 0,
        entries: Vec::with_capacity(ENTRIES),
        scratch: Vec::new(),
        depth: 0,
    };
    c.value(out)?;
    c.ws();
    if c.i != c.s.len() {
        return Err(CanonicalError::Malformed(c.i));
    }
    Ok(())
}

/// Object entries room is made for at first: a chat message's keys (`role`, `content`,
/// `tool_calls`, `name`, ...) and a content block's, in one allocation.
const ENTRIES: usize = 8;

/// A cursor over JSON text.
struct Canon<'a> {
    text: &'a str,
    s: &'a [u8],
    i: usize,
    /// The entries of the objects being written, innermost last (one allocation per call,
    /// not per object).
    entries: Vec<Entry<'a>>,
    /// A copy of an object's entries while they are written back in key order.
    scratch: Vec<u8>,
    /// Arrays and objects open around the cursor.
    depth: usize,
}

/// One object entry written in input order: its unescaped key and where its key and value
/// were written in the output.
struct Entry<'a> {
    key: Cow<'a, str>,
    written: std::ops::Range<usize>,
}

impl<'a> Canon<'a> {
    fn malformed(&self) -> CanonicalError {
        CanonicalError::Malformed(self.i)
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\r' | b'\t')) {
            self.i += 1;
        }
    }

    fn expect(&mut self, b: u8) -> Result<(), CanonicalError> {
        self.ws();
        if self.peek() != Some(b) {
            return Err(self.malformed());
        }
        self.i += 1;
        Ok(())
    }

    fn value(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        self.ws();
        match self.peek() {
            Some(open @ (b'{' | b'[')) => {
                if self.depth == MAX_DEPTH {
                    return Err(CanonicalError::TooDeep);
                }
                self.depth += 1;
                let written = if open == b'{' {
                    self.object(out)
                } else {
                    self.array(out)
                };
                self.depth -= 1;
                written
            }
            Some(b'"') => {
                let s = self.string()?;
                write_string(s, out)
            }
            Some(b't') => self.literal(b"true", out),
            Some(b'f') => self.literal(b"false", out),
            Some(b'n') => self.literal(b"null", out),
            Some(b'-' | b'0'..=b'9') => self.number(out),
            _ => Err(self.malformed()),
        }
    }

    fn literal(&mut self, word: &[u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        if !self.s[self.i..].starts_with(word) {
            return Err(self.malformed());
        }
        self.i += word.len();
        out.extend_from_slice(word);
        Ok(())
    }

    /// A string token (quotes included), with whether it holds an escape.
    fn string(&mut self) -> Result<RawString<'a>, CanonicalError> {
        let start = self.i;
        self.i += 1;
        let mut escaped = false;
        loop {
            let rest = self.s.get(self.i..).ok_or_else(|| self.malformed())?;
            let Some(at) = quote_or_backslash(rest) else {
                return Err(self.malformed());
            };
            self.i += at;
            if self.s[self.i] == b'"' {
                self.i += 1;
                // Quotes are ASCII, so both ends are character boundaries.
                let token = self
                    .text
                    .get(start..self.i)
                    .ok_or_else(|| self.malformed())?;
                return Ok(RawString { token, escaped });
            }
            // A backslash: skip it and the character it escapes (`\u` digits are plain).
            escaped = true;
            self.i += 2;
        }
    }

    fn number(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        let start = self.i;
        while matches!(
            self.peek(),
            Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
        ) {
            self.i += 1;
        }
        let token = &self.s[start..self.i];
        // An integer of up to 18 digits is an i64, which serde_json writes as it reads it
        // (JSON has no leading zeros); `-0` and anything else go through serde_json.
        let digits = token.strip_prefix(b"-").unwrap_or(token);
        let plain = !digits.is_empty()
            && digits.len() <= 18
            && digits.iter().all(u8::is_ascii_digit)
            && token != b"-0";
        if plain {
            out.extend_from_slice(token);
            return Ok(());
        }
        let number: serde_json::Number = serde_json::from_slice(token)?;
        serde_json::to_writer(&mut *out, &number)?;
        Ok(())
    }

    fn array(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        self.i += 1;
        out.push(b'[');
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            out.push(b']');
            return Ok(());
        }
        loop {
            self.value(out)?;
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    out.push(b',');
                }
                Some(b']') => {
                    self.i += 1;
                    out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.malformed()),
            }
        }
    }

    /// Writes the entries in input order, then, unless their keys already are sorted and
    /// distinct, writes them again from a copy in key order.
    fn object(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        self.i += 1;
        let start = out.len();
        out.push(b'{');
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            out.push(b'}');
            return Ok(());
        }
        let base = self.entries.len();
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.malformed());
            }
            let key = self.string()?;
            let at = out.len();
            write_string(key, out)?;
            self.expect(b':')?;
            out.push(b':');
            self.value(out)?;
            self.entries.push(Entry {
                key: key.unescaped()?,
                written: at..out.len(),
            });
            self.ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    out.push(b',');
                }
                Some(b'}') => {
                    self.i += 1;
                    break;
                }
                _ => return Err(self.malformed()),
            }
        }
        let entries = &mut self.entries[base..];
        let ordered = entries
            .windows(2)
            .all(|w| w[0].key.as_bytes() < w[1].key.as_bytes());
        if !ordered {
            // Stable, so of equal keys the last stays last, and only it is written (serde_json's
            // map keeps the last).
            entries.sort_by(|a, b| a.key.as_bytes().cmp(b.key.as_bytes()));
            self.scratch.clear();
            self.scratch.extend_from_slice(&out[start..]);
            out.truncate(start);
            out.push(b'{');
            let mut first = true;
            for (n, e) in entries.iter().enumerate() {
                if entries.get(n + 1).is_some_and(|next| next.key == e.key) {
                    continue;
                }
                if !first {
                    out.push(b',');
                }
                first = false;
                let range = e.written.start - start..e.written.end - start;
                out.extend_from_slice(&self.scratch[range]);
            }
        }
        self.entries.truncate(base);
        out.push(b'}');
        Ok(())
    }
}

/// A string token as it appears in the input.
#[derive(Clone, Copy)]
struct RawString<'a> {
    /// With its quotes.
    token: &'a str,
    escaped: bool,
}

impl<'a> RawString<'a> {
    fn unescaped(self) -> Result<Cow<'a, str>, CanonicalError> {
        if self.escaped {
            Ok(Cow::Owned(serde_json::from_str::<String>(self.token)?))
        } else {
            Ok(Cow::Borrowed(&self.token[1..self.token.len() - 1]))
        }
    }
}

/// A string as serde_json writes it. An unescaped token already is that form (valid JSON
/// strings hold no raw quote, backslash or control character); an escaped one is rewritten
/// escape by escape: `\"`, `\\` and the short control escapes stay, `\/` and `\uXXXX` of a
/// character serde_json does not escape become the character, other control characters become
/// `\u00xx`.
fn write_string(s: RawString<'_>, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
    let token = s.token.as_bytes();
    if !s.escaped {
        out.extend_from_slice(token);
        return Ok(());
    }
    let bad = || CanonicalError::Malformed(0);
    let inner = token
        .get(1..token.len().saturating_sub(1))
        .ok_or_else(bad)?;
    out.push(b'"');
    let mut i = 0;
    while i < inner.len() {
        // The inner text holds no bare quote: the first hit is a backslash.
        let Some(at) = quote_or_backslash(&inner[i..]) else {
            out.extend_from_slice(&inner[i..]);
            break;
        };
        out.extend_from_slice(&inner[i..i + at]);
        i += at;
        let kind = *inner.get(i + 1).ok_or_else(bad)?;
        i += 2;
        match kind {
            b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f' => {
                out.extend_from_slice(&[b'\\', kind])
            }
            b'/' => out.push(b'/'),
            b'u' => {
                let unit = hex4(inner.get(i..i + 4).ok_or_else(bad)?).ok_or_else(bad)?;
                i += 4;
                let code = match unit {
                    0xD800..=0xDBFF => {
                        // A leading surrogate must be followed by `\u` and a trailing one.
                        let low = match inner.get(i..i + 6) {
                            Some([b'\\', b'u', digits @ ..]) => hex4(digits).ok_or_else(bad)?,
                            _ => return Err(bad()),
                        };
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(bad());
                        }
                        i += 6;
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return Err(bad()),
                    unit => unit,
                };
                write_char(char::from_u32(code).ok_or_else(bad)?, out);
            }
            _ => return Err(bad()),
        }
    }
    out.push(b'"');
    Ok(())
}

/// Four hex digits.
fn hex4(digits: &[u8]) -> Option<u32> {
    if digits.len() != 4 {
        return None;
    }
    digits.iter().try_fold(0u32, |acc, d| {
        let v = (*d as char).to_digit(16)?;
        Some(acc * 16 + v)
    })
}

/// One character as serde_json writes it inside a string.
fn write_char(c: char, out: &mut Vec<u8>) {
    match c {
        '"' => out.extend_from_slice(b"\\\""),
        '\\' => out.extend_from_slice(b"\\\\"),
        '\n' => out.extend_from_slice(b"\\n"),
        '\r' => out.extend_from_slice(b"\\r"),
        '\t' => out.extend_from_slice(b"\\t"),
        '\u{8}' => out.extend_from_slice(b"\\b"),
        '\u{c}' => out.extend_from_slice(b"\\f"),
        c if (c as u32) < 0x20 => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let b = c as usize;
            out.extend_from_slice(b"\\u00");
            out.push(HEX[b >> 4]);
            out.push(HEX[b & 0xf]);
        }
        c => {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    /// The reference: parse into a `Value` and write it with keys sorted.
    fn reference(json: &[u8]) -> Vec<u8> {
        fn write(v: &Value, out: &mut Vec<u8>) {
            match v {
                Value::Object(map) => {
                    let mut entries: Vec<_> = map.iter().collect();
                    entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                    out.push(b'{');
                    for (i, (k, v)) in entries.into_iter().enumerate() {
                        if i > 0 {
                            out.push(b',');
                        }
                        serde_json::to_writer(&mut *out, k).expect("key");
                        out.push(b':');
                        write(v, out);
                    }
                    out.push(b'}');
                }
                Value::Array(items) => {
                    out.push(b'[');
                    for (i, v) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(b',');
                        }
                        write(v, out);
                    }
                    out.push(b']');
                }
                other => serde_json::to_writer(&mut *out, other).expect("scalar"),
            }
        }
        let v: Value = serde_json::from_slice(json).expect("reference parses");
        let mut out = Vec::new();
        write(&v, &mut out);
        out
    }

    #[test]
    fn nesting_is_written_up_to_serde_json_s_limit_and_refused_past_it() {
        let nested = |depth: usize| {
            format!(
                "{}0{}",
                "[{\"a\":".repeat(depth / 2),
                "}]".repeat(depth / 2)
            )
        };
        // serde_json parses (so the reference can be written) up to one level less.
        let parseable = nested(MAX_DEPTH - 2);
        assert_eq!(
            canonical_json(parseable.as_bytes()).expect("as deep as serde_json reads"),
            reference(parseable.as_bytes())
        );
        assert!(canonical_json(nested(MAX_DEPTH).as_bytes()).is_ok());
        assert!(matches!(
            canonical_json(nested(MAX_DEPTH + 2).as_bytes()),
            Err(CanonicalError::TooDeep)
        ));
        // Far past it (a valid RawValue: serde_json skips values without recursing), an error
        // and no stack overflow.
        let deep = format!("{}0{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
        let raw: &serde_json::value::RawValue =
            serde_json::from_str(&deep).expect("serde_json skips it iteratively");
        assert!(matches!(
            canonical_into(raw.get(), &mut Vec::new()),
            Err(CanonicalError::TooDeep)
        ));
    }

    #[test]
    fn matches_serde_json_on_tricky_inputs() {
        for json in [
            r#"{"role":"user","content":[{"type":"text","text":"hi"}]}"#,
            r#" { "b" : 1 , "a" : [ 1.0 , 1.50, -0, 0, -12, 1e3, 2E-2, 123456789012345678901234 ] } "#,
            r#"{"t":"caf\u00e9 \/ \u0041 \" \\ \n \u001f \u001F \u000a \u0022 \u005C \u0008\b\f\r\t \ud83e\udd80 \u007f","\u0062":1,"a":2}"#,
            r#"{"a":1,"a":2,"b":{"z":null,"y":true,"x":false}}"#,
            r#"[[],{},"",[{}]]"#,
            r#""just a string""#,
            "{\"é\":1,\"e\":2,\"\\u00e9x\":3}",
        ] {
            let mut out = Vec::new();
            canonical_into(json, &mut out).expect(json);
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&reference(json.as_bytes())),
                "{json}"
            );
        }
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        for bad in [
            "",
            "{",
            "{\"a\"",
            "{\"a\":}",
            "[1,",
            "\"open",
            "tru",
            "{\"a\":1,}",
            "1 2",
            "\"\\",
            r#""\ud83e""#,
            r#""\udd80""#,
            r#""\u12""#,
            r#""\x""#,
        ] {
            let mut out = Vec::new();
            assert!(canonical_into(bad, &mut out).is_err(), "{bad:?}");
            assert!(canonical_json(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z\"\\\\é日\u{1}/ ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec(("[a-dé\"]{0,3}", inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any value, written compactly or pretty, with its keys in any order: the same bytes as
        /// the `Value` reference.
        #[test]
        fn agrees_with_the_value_reference(v in json_value(), pretty in any::<bool>()) {
            let text = if pretty {
                serde_json::to_string_pretty(&v).expect("pretty")
            } else {
                serde_json::to_string(&v).expect("compact")
            };
            let mut out = Vec::new();
            canonical_into(&text, &mut out).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(out, reference(text.as_bytes()));
        }
    }
}
