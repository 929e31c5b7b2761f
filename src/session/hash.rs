//! Identity by content: canonical JSON, chained message hashes, tenants and session ids.
//!
//! The proxy sees stateless requests, so a conversation is recognised by what it says, not by
//! a handle. Each message is canonicalised ([`super::canonical`]: object keys sorted, no
//! insignificant whitespace) so two serialisations of the same message hash alike, and folded
//! into a chain `h_k = sha256(h_{k-1} || len || canonical(msg_k))` that starts from the
//! caller's [`TenantId`]: a checkpoint stored under `h_k` matches exactly the requests that
//! carry the same first `k` messages from the same credential. The tenant is a hash of the
//! credential, never the credential itself; every printed form of these values is short hex.

use std::fmt;

use compactor_plugin_api::Caller;
use serde::{Serialize, Serializer};
use sha2::{Digest, Sha256};

use super::canonical::canonical_into;
pub use super::canonical::{canonical_json, CanonicalError};

/// Credential headers that identify a tenant, in order of preference (lowercase).
pub const TENANT_CREDENTIAL_HEADERS: [&str; 4] =
    ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// A client-sent session id longer than this is replaced by its hash.
pub const SESSION_ID_MAX_LEN: usize = 128;

/// How many leading messages a derived session id covers at least (system + first user,
/// typically); the pipeline extends it through the model's first reply
/// ([`first_reply`](crate::dialect::reply::first_reply)).
pub const SESSION_ID_MESSAGES: usize = 2;

/// Domain separators, so a hash of one kind can never equal a hash of another.
const TENANT_DOMAIN: &[u8] = b"compactor/tenant/v1\0";
const CHAIN_DOMAIN: &[u8] = b"compactor/chain/v1\0";
const SESSION_DOMAIN: &[u8] = b"compactor/session/v1\0";
const SESSION_HEADER_DOMAIN: &[u8] = b"compactor/session-header/v1\0";

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// Who is calling: a truncated sha256 of the request's credential, or [`TenantId::ANONYMOUS`].
///
/// Printed (`Debug`, `Display`, serde) as 12 hex digits; the credential is never kept.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub [u8; 16]);

impl Default for TenantId {
    /// [`TenantId::ANONYMOUS`].
    fn default() -> Self {
        TenantId::ANONYMOUS
    }
}

impl TenantId {
    /// The tenant of requests that carry no credential.
    pub const ANONYMOUS: TenantId = TenantId([0; 16]);

    /// The tenant of `caller`: its first present, non-blank credential among
    /// [`TENANT_CREDENTIAL_HEADERS`], else [`TenantId::ANONYMOUS`].
    pub fn from_caller(caller: &Caller) -> TenantId {
        TENANT_CREDENTIAL_HEADERS
            .iter()
            .filter_map(|name| caller.credential(name))
            .find(|value| !value.trim().is_empty())
            .map_or(TenantId::ANONYMOUS, TenantId::from_credential)
    }

    /// The tenant of one credential value. A leading `Bearer ` is ignored, so the same key sent
    /// as `authorization: Bearer k` or `x-api-key: k` is the same tenant.
    pub fn from_credential(value: &str) -> TenantId {
        let value = value.trim();
        let secret = match value.get(..7) {
            Some(prefix) if prefix.eq_ignore_ascii_case("bearer ") => value[7..].trim_start(),
            _ => value,
        };
        let digest = Sha256::new()
            .chain_update(TENANT_DOMAIN)
            .chain_update(secret.as_bytes())
            .finalize();
        let mut id = [0u8; 16];
        id.copy_from_slice(&digest[..16]);
        TenantId(id)
    }

    /// All 32 hex digits (for store keys).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    fn short_hex(&self) -> String {
        hex(&self.0[..6])
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId({})", self.short_hex())
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.short_hex())
    }
}

impl Serialize for TenantId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.short_hex())
    }
}

/// The chain hash of a conversation prefix: `h_k` covers messages `[0..k)` of one tenant.
///
/// Printed (`Debug`, `Display`) as 16 hex digits; [`ChainHash::to_hex`] gives all 64.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChainHash(pub [u8; 32]);

impl ChainHash {
    /// `h_0`, the empty prefix of `tenant`'s conversations.
    pub fn start(tenant: &TenantId) -> ChainHash {
        let digest = Sha256::new()
            .chain_update(CHAIN_DOMAIN)
            .chain_update(tenant.0)
            .finalize();
        ChainHash(digest.into())
    }

    /// `h_{k+1} = sha256(h_k || u64_be(len) || canonical_message)`.
    pub fn next(&self, canonical_message: &[u8]) -> ChainHash {
        let digest = Sha256::new()
            .chain_update(self.0)
            .chain_update((canonical_message.len() as u64).to_be_bytes())
            .chain_update(canonical_message)
            .finalize();
        ChainHash(digest.into())
    }

    /// All 64 hex digits (for store keys).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for ChainHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChainHash({})", hex(&self.0[..8]))
    }
}

impl fmt::Display for ChainHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0[..8]))
    }
}

/// `h_1..h_n` of `messages` for `tenant`: element `k-1` covers `messages[0..k)`.
///
/// Fails when a message is not JSON (the caller then treats the request as uncompactable).
pub fn chain(tenant: &TenantId, messages: &[&str]) -> Result<Vec<ChainHash>, CanonicalError> {
    let mut hashes = Vec::with_capacity(messages.len());
    let mut buf = Vec::new();
    let mut h = ChainHash::start(tenant);
    for message in messages {
        h = canonical_chain_step(&h, message, &mut buf)?;
        hashes.push(h);
    }
    Ok(hashes)
}

/// `h_{k+1}` from `h_k` and message `k` (its JSON text), canonicalised in `buf`.
pub(crate) fn canonical_chain_step(
    h: &ChainHash,
    message: &str,
    buf: &mut Vec<u8>,
) -> Result<ChainHash, CanonicalError> {
    canonical_into(message, buf)?;
    Ok(h.next(buf))
}

/// The short id of a conversation, for the admin API, logs and the response header.
///
/// - `header_value` (the client's session header), trimmed, when non-empty: kept as is when it
///   is at most [`SESSION_ID_MAX_LEN`] characters of `A-Z a-z 0-9 - _ . : ~ @ + =` (safe in a
///   header and in the `/session/{id}` path), otherwise replaced by 16 hex digits of its hash.
/// - otherwise 16 hex digits derived from `tenant` and the canonical form of
///   `first_messages`, the messages that identify the conversation (its opening, through the
///   model's first reply once there is one), so every request of one conversation gets the
///   same id. Pass the system prompt first when the dialect keeps it outside the message
///   array, or two conversations opening with the same user message share an id. Each message
///   is its JSON text, as sent.
pub fn session_id(
    tenant: &TenantId,
    header_value: Option<&str>,
    first_messages: &[&str],
) -> String {
    if let Some(value) = header_value.map(str::trim).filter(|v| !v.is_empty()) {
        if value.len() <= SESSION_ID_MAX_LEN && value.bytes().all(session_id_byte) {
            return value.to_string();
        }
        let digest = Sha256::new()
            .chain_update(SESSION_HEADER_DOMAIN)
            .chain_update(value.as_bytes())
            .finalize();
        return hex(&digest[..8]);
    }
    derived_session_ids(tenant, first_messages, &[]).0
}

/// The derived ids ([`session_id`] without a header) of `opening` and of `opening` followed by
/// `then`, hashing the opening once.
pub fn derived_session_ids(tenant: &TenantId, opening: &[&str], then: &[&str]) -> (String, String) {
    let mut hasher = Sha256::new()
        .chain_update(SESSION_DOMAIN)
        .chain_update(tenant.0);
    let mut buf = Vec::new();
    let mut add = |hasher: &mut Sha256, message: &str| {
        // A message that is not JSON still gets a stable id from its raw bytes.
        let bytes = match canonical_into(message, &mut buf) {
            Ok(()) => buf.as_slice(),
            Err(_) => message.as_bytes(),
        };
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    for message in opening {
        add(&mut hasher, message);
    }
    let first = hex(&hasher.clone().finalize()[..8]);
    if then.is_empty() {
        return (first.clone(), first);
    }
    for message in then {
        add(&mut hasher, message);
    }
    (first, hex(&hasher.finalize()[..8]))
}

fn session_id_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-_.:~@+=".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<serde_json::value::RawValue> {
        serde_json::value::RawValue::from_string(s.to_string()).unwrap()
    }

    fn hashes(tenant: &TenantId, msgs: &[&str]) -> Vec<ChainHash> {
        let owned: Vec<Box<serde_json::value::RawValue>> = msgs.iter().map(|m| raw(m)).collect();
        let refs: Vec<&str> = owned.iter().map(|b| b.get()).collect();
        chain(tenant, &refs).unwrap()
    }

    fn tenant() -> TenantId {
        TenantId::from_credential("Bearer sk-test")
    }

    #[test]
    fn canonical_sorts_keys_and_drops_whitespace() {
        let a =
            canonical_json(br#"{"role":"user","content":[{"type":"text","text":"hi"}]}"#).unwrap();
        let b = canonical_json(
            b"{ \"content\" : [ { \"text\" : \"hi\" , \"type\" : \"text\" } ] ,\n \"role\" : \"user\" }",
        )
        .unwrap();
        assert_eq!(a, b);
        assert_eq!(
            String::from_utf8(a).unwrap(),
            r#"{"content":[{"text":"hi","type":"text"}],"role":"user"}"#
        );
    }

    #[test]
    fn canonical_normalises_escapes() {
        let a = canonical_json(br#"{"t":"caf\u00e9 \/ \u0041"}"#).unwrap();
        let b = canonical_json("{\"t\":\"café / A\"}".as_bytes()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn canonical_sorts_nested_objects_but_keeps_array_order() {
        let a = canonical_json(br#"{"b":{"y":1,"x":[3,1,2]},"a":null}"#).unwrap();
        assert_eq!(a, br#"{"a":null,"b":{"x":[3,1,2],"y":1}}"#);
        let swapped = canonical_json(br#"{"b":{"y":1,"x":[1,3,2]},"a":null}"#).unwrap();
        assert_ne!(a, swapped);
    }

    #[test]
    fn canonical_rejects_non_json() {
        assert!(canonical_json(b"{not json").is_err());
        assert!(canonical_json(b"").is_err());
    }

    #[test]
    fn equivalent_serialisations_chain_alike() {
        let t = tenant();
        let a = hashes(
            &t,
            &[
                r#"{"role":"system","content":"be brief"}"#,
                r#"{"role":"user","content":"caf\u00e9"}"#,
            ],
        );
        let b = hashes(
            &t,
            &[
                "{ \"content\": \"be brief\", \"role\": \"system\" }",
                "{\"content\":\"café\",\"role\":\"user\"}",
            ],
        );
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], a[1]);
    }

    #[test]
    fn a_change_alters_that_hash_and_every_later_one() {
        let t = tenant();
        let base = hashes(
            &t,
            &[r#"{"c":1}"#, r#"{"c":2}"#, r#"{"c":3}"#, r#"{"c":4}"#],
        );
        let edited = hashes(
            &t,
            &[r#"{"c":1}"#, r#"{"c":20}"#, r#"{"c":3}"#, r#"{"c":4}"#],
        );
        assert_eq!(base[0], edited[0]);
        for k in 1..4 {
            assert_ne!(base[k], edited[k], "h_{}", k + 1);
        }
        let inserted = hashes(
            &t,
            &[
                r#"{"c":1}"#,
                r#"{"c":1.5}"#,
                r#"{"c":2}"#,
                r#"{"c":3}"#,
                r#"{"c":4}"#,
            ],
        );
        assert_eq!(base[0], inserted[0]);
        for later in &inserted[1..] {
            assert!(
                !base.contains(later),
                "{later:?} collides with the original chain"
            );
        }
    }

    #[test]
    fn message_boundaries_matter() {
        // Length prefixes keep ["ab"] + ["c"] apart from ["a"] + ["bc"] even as raw bytes.
        let t = tenant();
        let h0 = ChainHash::start(&t);
        assert_ne!(h0.next(b"ab").next(b"c"), h0.next(b"a").next(b"bc"));
    }

    #[test]
    fn tenants_isolate_identical_content() {
        let msgs = [r#"{"role":"user","content":"hi"}"#];
        let a = hashes(&TenantId::from_credential("Bearer sk-a"), &msgs);
        let b = hashes(&TenantId::from_credential("Bearer sk-b"), &msgs);
        let anon = hashes(&TenantId::ANONYMOUS, &msgs);
        assert_ne!(a, b);
        assert_ne!(a, anon);
    }

    #[test]
    fn tenant_from_caller_prefers_authorization_and_hides_the_key() {
        let caller = |creds: &[(&str, &str)]| Caller {
            credentials: creds
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            ..Caller::default()
        };
        let both = caller(&[
            ("x-api-key", "sk-other"),
            ("authorization", "Bearer sk-secret"),
        ]);
        let t = TenantId::from_caller(&both);
        assert_eq!(t, TenantId::from_credential("sk-secret"));
        assert_eq!(
            t,
            TenantId::from_caller(&caller(&[("x-api-key", "sk-secret")]))
        );
        assert_eq!(TenantId::from_caller(&caller(&[])), TenantId::ANONYMOUS);
        assert_eq!(
            TenantId::from_caller(&caller(&[("api-key", "  ")])),
            TenantId::ANONYMOUS
        );
        assert_ne!(t, TenantId::ANONYMOUS);
        for shown in [
            format!("{t:?}"),
            t.to_string(),
            serde_json::to_string(&t).unwrap(),
        ] {
            assert!(!shown.contains("sk-secret"), "{shown}");
        }
        assert_eq!(t.to_string().len(), 12);
        assert_eq!(t.to_hex().len(), 32);
    }

    #[test]
    fn chain_hash_prints_short_hex() {
        let h = ChainHash::start(&TenantId::ANONYMOUS);
        assert_eq!(h.to_string().len(), 16);
        assert_eq!(format!("{h:?}"), format!("ChainHash({h})"));
        assert!(h.to_hex().starts_with(&h.to_string()));
    }

    #[test]
    fn session_id_from_header() {
        let t = tenant();
        assert_eq!(session_id(&t, Some(" conv-42 "), &[]), "conv-42");
        let uuid = "0b6e1a3c-8a5e-4c3e-9a53-1d2f3e4a5b6c";
        assert_eq!(session_id(&t, Some(uuid), &[]), uuid);
        for odd in ["a/b", "héllo", "x y", &"z".repeat(SESSION_ID_MAX_LEN + 1)] {
            let id = session_id(&t, Some(odd), &[]);
            assert_eq!(id.len(), 16, "{odd} → {id}");
            assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(id, session_id(&t, Some(odd), &[]), "stable");
        }
        assert_ne!(
            session_id(&t, Some("a/b"), &[]),
            session_id(&t, Some("a/c"), &[])
        );
    }

    #[test]
    fn session_id_derived_from_first_messages() {
        let t = tenant();
        let sys = r#"{"role":"system","content":"s"}"#;
        let sys_spaced = r#"{ "content": "s", "role": "system" }"#;
        let user = r#"{"role":"user","content":"task"}"#;
        let later = r#"{"role":"assistant","content":"done"}"#;
        let other = r#"{"role":"user","content":"other task"}"#;
        let short = session_id(&t, None, &[sys, user]);
        assert_eq!(short.len(), 16);
        // Formatting does not change the id; every message passed does.
        assert_eq!(short, session_id(&t, None, &[sys_spaced, user]));
        assert_ne!(short, session_id(&t, None, &[sys, user, later]));
        assert_eq!(short, session_id(&t, Some("  "), &[sys, user]));
        assert_ne!(short, session_id(&t, None, &[sys, other]));
        assert_ne!(short, session_id(&TenantId::ANONYMOUS, None, &[sys, user]));
        // Both ids in one pass: the opening's, and the opening's followed by more.
        assert_eq!(
            derived_session_ids(&t, &[sys, user], &[later]),
            (short.clone(), session_id(&t, None, &[sys, user, later]))
        );
        assert_eq!(
            derived_session_ids(&t, &[sys, user], &[]),
            (short.clone(), short)
        );
    }
}
