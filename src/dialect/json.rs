//! JSON plumbing shared by the dialects (Chat Completions uses the top level and string
//! counting; Anthropic Messages and OpenAI Responses everything): the
//! order-preserving top level, zero-copy token counting driven by per-dialect [`Rules`], and
//! the small writers the rewrites use.
//!
//! Counting follows one rule for every content node (an Anthropic message or content block, a
//! Responses input item or content part): a node whose `type` names an image costs one image;
//! any other node counts the weight ([`crate::estimate::text_weight`]) of its string leaves,
//! except under keys the model does not read as text (ids, signatures, cache markers,
//! statuses), with the dialect's *nested* keys (`content`, `output`, ...) counted recursively
//! as nodes (so images inside a tool result count as images) and its *raw* keys (Anthropic's
//! `input` object) counted as the JSON text sent, `\uXXXX` escapes of non-ASCII characters
//! aside ([`crate::estimate::json_weight`]). Keys are classified and strings counted as
//! serde_json hands them over: nothing is allocated or copied, except a raw value holding
//! `\u` escapes, written once without them. The common shapes are read by hand first (the
//! fast path at the end), which counts the same and leaves everything else to serde.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::split::{skip_ws, value};
use crate::estimate::{
    json_literal_weight, json_string_weight, json_weight, quote_backslash_or_control, text_weight,
    Counts,
};

/// The [`Visitor`] methods for the JSON scalars the model does not read (booleans, numbers,
/// `null`): each answers `$value`. Strings, arrays and objects stay with each visitor.
macro_rules! skip_scalars {
    ($ty:ty, $value:expr) => {
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<$ty, E> {
            Ok($value)
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<$ty, E> {
            Ok($value)
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<$ty, E> {
            Ok($value)
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<$ty, E> {
            Ok($value)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<$ty, E> {
            Ok($value)
        }
    };
}
pub(crate) use skip_scalars;

/// How a dialect's content nodes are counted.
#[derive(Debug)]
pub(crate) struct Rules {
    /// Keys whose values the model does not read as text.
    pub skip: &'static [&'static str],
    /// Keys holding content (a string, a node or an array of nodes), counted recursively.
    pub nested: &'static [&'static str],
    /// Keys whose value counts as its JSON text (a tool's input object).
    pub raw: &'static [&'static str],
    /// `type` values that make a node an image.
    pub image_types: &'static [&'static str],
    /// Keys whose presence makes a node an image, their values unread (Gemini's `inlineData`
    /// and `fileData` parts, which have no `type`).
    pub image_keys: &'static [&'static str],
}

/// Weight of every string leaf (not keys) of a parsed value.
pub(crate) fn leaf_weight(v: &Value) -> usize {
    match v {
        Value::String(s) => text_weight(s),
        Value::Array(items) => items.iter().map(leaf_weight).fold(0, usize::saturating_add),
        Value::Object(map) => map.values().map(leaf_weight).fold(0, usize::saturating_add),
        _ => 0,
    }
}

/// A non-negative token count from a JSON number (`max_tokens` and friends).
pub(crate) fn as_tokens(v: Option<&Value>) -> Option<usize> {
    let n = v?.as_f64()?;
    (n.is_finite() && n >= 0.0).then(|| n.min(usize::MAX as f64) as usize)
}

/// Counts of one `raw` node under `rules`.
pub(crate) fn node_counts(raw: &str, rules: &'static Rules) -> Result<Counts, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(raw);
    let counts = NodeSeed(rules).deserialize(&mut de)?;
    de.end()?;
    Ok(counts)
}

// ---------------------------------------------------------------------------------------------
// Order-preserving top level.

/// The fields of a JSON object in order, values raw.
pub(crate) struct OrderedObject<'a>(pub Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for OrderedObject<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = OrderedObject<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut fields = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value: &'a RawValue = map.next_value()?;
                    fields.push((key, value));
                }
                Ok(OrderedObject(fields))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

impl std::fmt::Debug for OrderedObject<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

impl<'a> OrderedObject<'a> {
    /// Index of the first field named `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.0.iter().position(|(k, _)| k == name)
    }

    /// Writes the object with the field at `at` replaced by `write`'s output, every other
    /// field raw and in order.
    pub fn write_replacing(
        &self,
        out: &mut Vec<u8>,
        at: usize,
        write: impl FnOnce(&mut Vec<u8>) -> Result<(), serde_json::Error>,
    ) -> Result<(), serde_json::Error> {
        let mut write = Some(write);
        out.push(b'{');
        for (i, (key, value)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, key)?;
            out.push(b':');
            match write.take_if(|_| i == at) {
                Some(w) => w(out)?,
                None => out.extend_from_slice(value.get().as_bytes()),
            }
        }
        out.push(b'}');
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Zero-copy counting.

/// What a key of a node is, under some rules.
enum KeyKind {
    Type,
    Image,
    Skip,
    Nested,
    Raw,
    Other,
}

struct KeySeed(&'static Rules);

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = KeyKind;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KeyKind, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed {
    type Value = KeyKind;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, k: &str) -> Result<KeyKind, E> {
        let rules = self.0;
        Ok(if k == "type" {
            KeyKind::Type
        } else if rules.image_keys.contains(&k) {
            KeyKind::Image
        } else if rules.skip.contains(&k) {
            KeyKind::Skip
        } else if rules.nested.contains(&k) {
            KeyKind::Nested
        } else if rules.raw.contains(&k) {
            KeyKind::Raw
        } else {
            KeyKind::Other
        })
    }
}

/// Whether a string value is one of a set (a `type` naming an image, a valid role); any other
/// JSON value is skipped and answers `false`.
pub(crate) struct OneOf(pub &'static [&'static str]);

impl<'de> DeserializeSeed<'de> for OneOf {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OneOf {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(self.0.contains(&v))
    }
    skip_scalars!(bool, false);
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }
}

/// The weight of a value that is usually one string (a text field, a tool call's arguments):
/// a string literal is weighed in place, escapes and all, without the copy decoding it takes
/// ([`json_string_weight`]); any other value is read again for its string leaves
/// ([`StrWeight`], which never comes back here, so no value is read more than twice).
/// Only for serde_json's deserializer (it borrows the value's raw text).
pub(crate) struct TextWeight(pub usize);

impl<'de> Deserialize<'de> for TextWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        raw_text_weight(raw.get())
            .map(TextWeight)
            .map_err(de::Error::custom)
    }
}

/// [`TextWeight`] of a value's raw JSON text.
pub(crate) fn raw_text_weight(raw: &str) -> Result<usize, serde_json::Error> {
    match json_string_weight(raw) {
        Some(weight) => Ok(weight),
        None => serde_json::from_str::<StrWeight>(raw).map(|w| w.0),
    }
}

/// Weight of all string leaves of any value (object keys excluded).
pub(crate) struct StrWeight(pub usize);

impl<'de> Deserialize<'de> for StrWeight {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrWeightVisitor).map(StrWeight)
    }
}

pub(crate) struct StrWeightVisitor;

impl<'de> Visitor<'de> for StrWeightVisitor {
    type Value = usize;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        Ok(text_weight(v))
    }
    skip_scalars!(usize, 0);
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while let Some(StrWeight(c)) = seq.next_element()? {
            n = n.saturating_add(c);
        }
        Ok(n)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while map.next_key::<IgnoredAny>()?.is_some() {
            n = n.saturating_add(map.next_value::<StrWeight>()?.0);
        }
        Ok(n)
    }
}

/// Content: a string, `null`, one node or an array of nodes (anything else counts its leaves).
#[derive(Clone, Copy)]
pub(crate) struct ContentSeed(pub &'static Rules);

impl<'de> DeserializeSeed<'de> for ContentSeed {
    type Value = Counts;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Counts, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentSeed {
    type Value = Counts;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("content")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Counts, E> {
        Ok(Counts::text(text_weight(v)))
    }
    skip_scalars!(Counts, Counts::default());
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Counts, A::Error> {
        let mut counts = Counts::default();
        while let Some(c) = seq.next_element_seed(NodeSeed(self.0))? {
            counts.add(c);
        }
        Ok(counts)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Counts, A::Error> {
        NodeSeed(self.0).visit_map(map)
    }
}

/// One content node (a block, a part, an item): an image, or the weight of what the model reads.
#[derive(Clone, Copy)]
pub(crate) struct NodeSeed(pub &'static Rules);

impl<'de> DeserializeSeed<'de> for NodeSeed {
    type Value = Counts;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Counts, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NodeSeed {
    type Value = Counts;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a content node")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Counts, E> {
        Ok(Counts::text(text_weight(v)))
    }
    skip_scalars!(Counts, Counts::default());
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Counts, A::Error> {
        StrWeightVisitor.visit_seq(seq).map(Counts::text)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Counts, A::Error> {
        let rules = self.0;
        let mut image = false;
        let mut counts = Counts::default();
        while let Some(kind) = map.next_key_seed(KeySeed(rules))? {
            match kind {
                KeyKind::Type => image = map.next_value_seed(OneOf(rules.image_types))?,
                KeyKind::Image => {
                    map.next_value::<IgnoredAny>()?;
                    image = true;
                }
                KeyKind::Skip => {
                    map.next_value::<IgnoredAny>()?;
                }
                KeyKind::Nested => counts.add(map.next_value_seed(ContentSeed(rules))?),
                KeyKind::Raw => {
                    let raw: &'de RawValue = map.next_value()?;
                    counts.add(Counts::text(json_weight(raw.get())));
                }
                KeyKind::Other => counts.add(Counts::text(map.next_value::<TextWeight>()?.0)),
            }
        }
        Ok(if image {
            Counts { text: 0, images: 1 }
        } else {
            counts
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Hand-read fast path.
//
// serde skipping a string literal to hand it over (or to capture it raw) walks it once, and
// weighing it walks it again; a chat body is mostly such literals. The readers below walk the
// common shapes by hand, so a literal is found and weighed in one pass
// ([`json_literal_weight`]), and hand every other value to serde one by one. They answer the
// same counts as the serde visitors above, or `None`, and then serde reads the whole message
// or item from its start and answers it (errors included): anything unusual is serde's.

/// How deep the hand-read path follows content, counted from the message or item it reads;
/// deeper content is left to serde. Far below serde's own limit (128 levels), so the hand-read
/// path never accepts what serde would refuse for its depth. The values handed to serde one by
/// one are read without that limit anyway (captured raw, or skipped).
const FAST_DEPTH: usize = 8;

/// Reads the object at the start of `text`: `value` reads each value, given its key and the
/// text from the value's first byte, and answers how many bytes it took. Answers the bytes the
/// object took; `None` when it is not an object of the plain shape (a key with an escape or a
/// control character, anything malformed) or `value` answers `None`.
pub(crate) fn fast_object<'a>(
    text: &'a str,
    mut value: impl FnMut(&'a str, &'a str) -> Option<usize>,
) -> Option<usize> {
    fast_sequence(text, b'{', b'}', |member| {
        let (key, len) = fast_str(member)?;
        let b = member.as_bytes();
        let colon = skip_ws(b, len);
        if b.get(colon) != Some(&b':') {
            return None;
        }
        let at = skip_ws(b, colon + 1);
        Some(at + value(key, member.get(at..)?)?)
    })
}

/// Reads the array at the start of `text`, `element` reading each element (from its first
/// byte) and answering how many bytes it took. Answers the bytes the array took.
fn fast_array<'a>(text: &'a str, element: impl FnMut(&'a str) -> Option<usize>) -> Option<usize> {
    fast_sequence(text, b'[', b']', element)
}

/// The object or array opened by `open` at the start of `text`, `item` reading each member or
/// element (from its first byte) and answering how many bytes it took: the bytes the whole
/// took, or `None` when it is malformed or `item` answers `None`.
fn fast_sequence<'a>(
    text: &'a str,
    open: u8,
    close: u8,
    mut item: impl FnMut(&'a str) -> Option<usize>,
) -> Option<usize> {
    let b = text.as_bytes();
    if b.first() != Some(&open) {
        return None;
    }
    let mut i = skip_ws(b, 1);
    if b.get(i) == Some(&close) {
        return Some(i + 1);
    }
    loop {
        i = skip_ws(b, i + item(text.get(i..)?)?);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(&c) if c == close => return Some(i + 1),
            _ => return None,
        }
    }
}

/// The string literal at the start of `text` when it has no escape and no control character
/// (keys, types, roles): its text and the bytes it takes.
pub(crate) fn fast_str(text: &str) -> Option<(&str, usize)> {
    let inside = text.strip_prefix('"')?;
    let len = quote_backslash_or_control(inside.as_bytes())?;
    (inside.as_bytes().get(len) == Some(&b'"')).then_some((inside.get(..len)?, len + 2))
}

/// Skips the value at the start of `text` (as [`IgnoredAny`]): the bytes it takes.
pub(crate) fn fast_skip(text: &str) -> Option<usize> {
    if text.starts_with('"') {
        // Most strings skipped are short and plain (roles, ids, names): found without
        // weighing them.
        if let Some((_, len)) = fast_str(text) {
            return Some(len);
        }
        if let Some((len, _)) = json_literal_weight(text.as_bytes()) {
            return Some(len);
        }
    }
    value::<IgnoredAny>(text).map(|(_, len)| len)
}

/// [`TextWeight`] of the value at the start of `text`, and the bytes it takes.
pub(crate) fn fast_text(text: &str) -> Option<(usize, usize)> {
    if text.starts_with('"') {
        if let Some((len, weight)) = json_literal_weight(text.as_bytes()) {
            return Some((weight, len));
        }
    }
    value::<TextWeight>(text).map(|(w, len)| (w.0, len))
}

/// A string, `null`, `true` or `false` at the start of `text`, counted as content or a node
/// counts them (a string's weight, nothing for the others), and the bytes it takes. `None` for
/// anything else (numbers too: serde would parse them, and refuse some).
fn fast_scalar(text: &str) -> Option<(Counts, usize)> {
    if text.starts_with('"') {
        return match json_literal_weight(text.as_bytes()) {
            Some((len, weight)) => Some((Counts::text(weight), len)),
            // A `\u` escape: decoded, as the visitors read strings.
            None => value::<StrWeight>(text).map(|(w, len)| (Counts::text(w.0), len)),
        };
    }
    ["null", "true", "false"]
        .into_iter()
        .find(|word| text.starts_with(word))
        .map(|word| (Counts::default(), word.len()))
}

/// What the fast readers pass over without reading further: each key of an object (its text:
/// a key with an escape is left to serde), and each value they do not descend into, as
/// written. A caller looking for substrings of a message sees every byte that could hold one
/// this way ([`super::outputs::MarksFound`]).
pub(crate) enum Piece<'a> {
    Key(&'a str),
    Value(&'a str),
}

/// [`ContentSeed`] of the value at the start of `text`, and the bytes it takes; `seen` is
/// shown the [`Piece`]s passed over.
pub(crate) fn fast_content(
    text: &str,
    rules: &'static Rules,
    depth: usize,
    seen: &mut dyn FnMut(Piece<'_>),
) -> Option<(Counts, usize)> {
    if depth > FAST_DEPTH {
        return None;
    }
    let scalar = |text: &str, seen: &mut dyn FnMut(Piece<'_>)| {
        let (counts, len) = fast_scalar(text)?;
        seen(Piece::Value(text.get(..len)?));
        Some((counts, len))
    };
    match text.as_bytes().first()? {
        b'[' => {
            let mut counts = Counts::default();
            let len = fast_array(text, |element| {
                // Each element a node: an object, or a scalar (an array is left to serde).
                let (c, len) = if element.starts_with('{') {
                    fast_node(element, rules, depth + 1, seen)?
                } else {
                    scalar(element, seen)?
                };
                counts.add(c);
                Some(len)
            })?;
            Some((counts, len))
        }
        b'{' => fast_node(text, rules, depth, seen),
        _ => scalar(text, seen),
    }
}

/// The counts of a message of a `role` (one of `roles`; when `role_required`, present) and
/// content under `content_key` (Anthropic's `content`, Gemini's `parts`) at the start of
/// `text`, read by hand, and the bytes it takes; `seen` is shown the [`Piece`]s passed over.
/// `None` leaves the message to serde (an unknown role too, so serde says what is wrong).
pub(crate) fn fast_role_content(
    text: &str,
    (content_key, roles, role_required): (&str, &[&str], bool),
    rules: &'static Rules,
    seen: &mut dyn FnMut(Piece<'_>),
) -> Option<(Counts, usize)> {
    let mut counts = Counts::default();
    let mut role_ok = !role_required;
    let len = fast_object(text, |key, rest| {
        seen(Piece::Key(key));
        let len = if key == "role" {
            let (role, len) = fast_str(rest)?;
            role_ok = roles.contains(&role);
            len
        } else if key == content_key {
            let (c, len) = fast_content(rest, rules, 1, seen)?;
            counts.add(c);
            return Some(len);
        } else {
            fast_skip(rest)?
        };
        seen(Piece::Value(rest.get(..len)?));
        Some(len)
    })?;
    role_ok.then_some((counts, len))
}

/// [`NodeSeed`] of the object at the start of `text`, and the bytes it takes; `seen` is shown
/// the [`Piece`]s passed over.
pub(crate) fn fast_node(
    text: &str,
    rules: &'static Rules,
    depth: usize,
    seen: &mut dyn FnMut(Piece<'_>),
) -> Option<(Counts, usize)> {
    if depth > FAST_DEPTH {
        return None;
    }
    let mut image = false;
    let mut counts = Counts::default();
    let len = fast_object(text, |key, rest| {
        let kind = KeySeed(rules).visit_str::<serde_json::Error>(key).ok()?;
        seen(Piece::Key(key));
        let len = match kind {
            KeyKind::Type => {
                let (kind, len) = fast_str(rest)?;
                image = rules.image_types.contains(&kind);
                len
            }
            KeyKind::Image => {
                image = true;
                fast_skip(rest)?
            }
            KeyKind::Skip => fast_skip(rest)?,
            KeyKind::Nested => {
                let (c, len) = fast_content(rest, rules, depth + 1, seen)?;
                counts.add(c);
                return Some(len);
            }
            KeyKind::Raw => {
                let (raw, len) = value::<&RawValue>(rest)?;
                counts.add(Counts::text(json_weight(raw.get())));
                len
            }
            KeyKind::Other => {
                let (weight, len) = fast_text(rest)?;
                counts.add(Counts::text(weight));
                len
            }
        };
        seen(Piece::Value(rest.get(..len)?));
        Some(len)
    })?;
    let counts = if image {
        Counts { text: 0, images: 1 }
    } else {
        counts
    };
    Some((counts, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    static RULES: Rules = Rules {
        skip: &["id", "cache_control"],
        nested: &["content"],
        raw: &["input"],
        image_types: &["image"],
        image_keys: &["inlineData"],
    };

    #[test]
    fn nodes_count_leaves_nested_content_raw_inputs_and_images() {
        let raw = r#"{"type":"tool_result","id":"skipped","cache_control":{"type":"x"},
            "content":[{"type":"text","text":"abcd"},{"source":{"data":"zzzz"},"type":"image"}],
            "input":{"a": "b"},"extra":["cd", 5, null]}"#;
        let c = node_counts(raw, &RULES).expect("counts");
        assert_eq!(c.images, 1);
        assert_eq!(c.text, text_weight(r#"abcd{"a": "b"}cd"#));
        assert!(node_counts("[1,", &RULES).is_err());
    }

    /// The hand-read path counts nodes and content as the serde visitors do, and takes the
    /// same bytes; what it leaves to serde it leaves whole.
    #[test]
    fn the_fast_path_counts_nodes_as_serde_does() {
        let output = "line \"q\"\n\té 日 \\ /".repeat(80);
        let big = serde_json::json!({"type": "tool_result", "id": "x", "content": output});
        let big = big.to_string();
        for node in [
            big.as_str(),
            r#"{"type":"tool_result","id":"skipped","cache_control":{"type":"x"},
                "content":[{"type":"text","text":"abcd"},{"source":{"data":"zzzz"},"type":"image"}],
                "input":{"a": "b \u00e9"},"extra":["cd", 5, null]}"#,
            r#"{ "type" : "text" , "text" : "a\u00e9b" , "n" : 1.5 , "b" : true }"#,
            r#"{"content":"plain","x":null}"#,
            r#"{"content":["loose", null, {"text":"t"}, true],"type":"image"}"#,
            r#"{"content":{"text":"one node"}}"#,
            "{}",
        ] {
            let expected = node_counts(node, &RULES).expect("serde counts it");
            for after in ["", ",{\"k\":1}]"] {
                let text = format!("{node}{after}");
                let (counts, len) = fast_node(&text, &RULES, 0, &mut |_| {}).expect("fast");
                assert_eq!((counts, len), (expected, node.len()), "{node}");
            }
        }
        let deep = format!("{}1{}", r#"{"content":["#.repeat(20), "]}".repeat(20));
        for left in [
            r#"{"content":[[1]]}"#,
            r#"{"content":5}"#,
            r#"{"type":"im\u0061ge"}"#,
            r#"{"ty\u0070e":"image"}"#,
            r#"{"a":"b",}"#,
            r#"{"a":"b""#,
            deep.as_str(),
        ] {
            assert!(fast_node(left, &RULES, 0, &mut |_| {}).is_none(), "{left}");
        }
    }

    #[test]
    fn ordered_objects_find_fields_and_write_replacements() {
        let o: OrderedObject<'_> =
            serde_json::from_str(r#"{"b": 1, "a" :[ 2 ], "c":"x"}"#).expect("object");
        assert_eq!(o.position("a"), Some(1));
        assert_eq!(o.position("z"), None);
        let mut out = Vec::new();
        o.write_replacing(&mut out, 1, |w| {
            w.extend_from_slice(b"[3]");
            Ok(())
        })
        .expect("writes");
        assert_eq!(String::from_utf8_lossy(&out), r#"{"b":1,"a":[3],"c":"x"}"#);
        assert_eq!(as_tokens(Some(&serde_json::json!(12))), Some(12));
        assert_eq!(as_tokens(Some(&serde_json::json!(-1))), None);
    }
}
