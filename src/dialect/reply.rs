//! Which wire messages the model wrote: the first one fixes a conversation's identity.
//!
//! A conversation without a session header is identified by how it opens (the session layer's
//! derived id). Two agents started on the same task (an eval harness running it k times, a
//! team's shared system prompt and first instruction) open with the same messages, so the
//! opening alone would make them one session. They part at the model's first reply at the
//! latest (its text, or the random ids of its tool calls), so the derived id covers the
//! messages through that reply: [`first_reply`] finds it.
//!
//! This runs on every request, over the opening messages only. Clients write the role (or the
//! Responses item type) as the object's first keys, so the leading string-valued keys are read
//! without parsing the rest of the message (an opening user message may be tens of kilobytes
//! of project instructions); a message whose leading keys say nothing is parsed whole.

use serde::Deserialize;

use super::DialectKind;

/// Messages looked at for the first reply; a conversation whose model has not spoken by then
/// is identified by its opening alone.
pub const FIRST_REPLY_WITHIN: usize = 32;

/// The index of the first message the model wrote among the first [`FIRST_REPLY_WITHIN`] of
/// `messages`, if any.
pub fn first_reply(dialect: DialectKind, messages: &[&str]) -> Option<usize> {
    messages
        .iter()
        .take(FIRST_REPLY_WITHIN)
        .position(|raw| from_model(dialect, raw))
}

/// Whether a wire message (a Responses input item) was written by the model: an assistant
/// message, or a Responses output item (a reasoning item or any tool call).
pub fn from_model(dialect: DialectKind, raw: &str) -> bool {
    let head = Head::leading(raw).unwrap_or_else(|| Head::parsed(raw));
    match dialect {
        DialectKind::ChatCompletions | DialectKind::Messages => head.role == Some("assistant"),
        DialectKind::Gemini => head.role == Some("model"),
        DialectKind::Responses => match head.kind {
            Some("reasoning") => true,
            Some(kind) if kind.ends_with("_call") => true,
            Some("message") | None => head.role == Some("assistant"),
            Some(_) => false,
        },
    }
}

/// The `role` and `type` of a message, as far as they were found.
#[derive(Debug, Default, PartialEq, Eq)]
struct Head<'a> {
    role: Option<&'a str>,
    kind: Option<&'a str>,
}

impl<'a> Head<'a> {
    /// Reads the object's leading `"key": "string"` pairs (no escapes) until the message is
    /// settled or a value is not a plain string. `None` when the leading keys named neither
    /// `role` nor a `type` that settles it.
    fn leading(raw: &'a str) -> Option<Head<'a>> {
        let mut head = Head::default();
        let mut rest = raw.trim_start().strip_prefix('{')?;
        loop {
            let (key, after) = plain_string(rest.trim_start())?;
            let after = after.trim_start().strip_prefix(':')?;
            let Some((value, after)) = plain_string(after.trim_start()) else {
                break;
            };
            match key {
                "role" => head.role = Some(value),
                "type" => head.kind = Some(value),
                _ => {}
            }
            // Read no further than needed: the values after it may be the message's text.
            if head.settled() {
                break;
            }
            match after.trim_start().strip_prefix(',') {
                Some(next) => rest = next,
                None => break,
            }
        }
        head.settled().then_some(head)
    }

    /// A role settles who wrote a message (only messages have one); so does a Responses item
    /// type other than `message`.
    fn settled(&self) -> bool {
        self.role.is_some() || self.kind.is_some_and(|k| k != "message")
    }

    /// Parses the whole message for its `role` and `type` (anything unreadable: neither).
    fn parsed(raw: &'a str) -> Head<'a> {
        #[derive(Deserialize)]
        struct Fields<'a> {
            #[serde(borrow, default)]
            role: Option<&'a str>,
            #[serde(borrow, default, rename = "type")]
            kind: Option<&'a str>,
        }
        match serde_json::from_str::<Fields<'a>>(raw) {
            Ok(f) => Head {
                role: f.role,
                kind: f.kind,
            },
            Err(_) => Head::default(),
        }
    }
}

/// A JSON string without escapes at the start of `s`: its contents and what follows it.
fn plain_string(s: &str) -> Option<(&str, &str)> {
    let body = s.strip_prefix('"')?;
    let end = memchr::memchr2(b'"', b'\\', body.as_bytes())?;
    (body.as_bytes()[end] == b'"').then(|| (&body[..end], &body[end + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_found_by_role_or_item_type_whatever_the_key_order() {
        let chat = DialectKind::ChatCompletions;
        assert!(from_model(chat, r#"{"role":"assistant","content":"hi"}"#));
        assert!(from_model(
            chat,
            r#"{ "content" : {"nested": "x"}, "role" : "assistant" }"#
        ));
        assert!(!from_model(
            chat,
            r#"{"role":"user","content":"the \"role\": \"assistant\""}"#
        ));
        assert!(!from_model(
            chat,
            r#"{"content":"say \"assistant\"","role":"system"}"#
        ));
        assert!(!from_model(chat, "not json"));
        let messages = DialectKind::Messages;
        assert!(from_model(
            messages,
            r#"{"role":"assistant","content":[{"type":"tool_use"}]}"#
        ));
        assert!(!from_model(
            messages,
            r#"{"role":"user","content":[{"type":"tool_result"}]}"#
        ));
        let responses = DialectKind::Responses;
        for item in [
            r#"{"type":"reasoning","id":"rs_1","encrypted_content":"x"}"#,
            r#"{"type":"function_call","call_id":"c1","name":"sh","arguments":"{}"}"#,
            r#"{"type":"custom_tool_call","call_id":"c1","name":"apply_patch"}"#,
            r#"{"type":"message","role":"assistant","content":[]}"#,
            r#"{"role":"assistant","content":"done"}"#,
            r#"{"content":[{"type":"output_text"}],"type":"message","role":"assistant"}"#,
        ] {
            assert!(from_model(responses, item), "{item}");
        }
        for item in [
            r#"{"type":"message","role":"user","content":[{"type":"input_text"}]}"#,
            r#"{"type":"message","role":"developer","content":"x"}"#,
            r#"{"type":"function_call_output","call_id":"c1","output":"ok"}"#,
            r#"{"role":"user","content":"hi"}"#,
            r#"{"content":[{"type":"input_text","text":"x"}],"role":"user"}"#,
        ] {
            assert!(!from_model(responses, item), "{item}");
        }
    }

    #[test]
    fn the_first_reply_is_looked_for_among_the_opening_messages_only() {
        let user = r#"{"role":"user","content":"go"}"#;
        let reply = r#"{"role":"assistant","content":"ok"}"#;
        let chat = DialectKind::ChatCompletions;
        assert_eq!(first_reply(chat, &[user, user, reply, user]), Some(2));
        assert_eq!(first_reply(chat, &[user, user]), None);
        let mut late = vec![user; FIRST_REPLY_WITHIN];
        late.push(reply);
        assert_eq!(first_reply(chat, &late), None);
    }
}
