//! Chain hashes and session ids remembered by the bytes they were computed from.
//!
//! Every request of a long conversation carries the same history again, and finding its
//! checkpoint means chain-hashing that history ([`super::hash::chain`]: canonical JSON and
//! SHA-256 per message). [`ChainMemo`] remembers each computed `h_k` under a fingerprint of the
//! raw bytes of messages `0..k` (XXH3 with a seed chained over them, the previous fingerprint
//! folded into the next seed), for that tenant, so the next request pays one fast fingerprint
//! per message and canonicalises and hashes only the messages it has not seen. XXH3 rather
//! than SipHash: the fingerprint reads every byte of every request's history, and SipHash
//! was a tenth of a 200 KB request's CPU. The fingerprint stands for the bytes, not their
//! canonical form: a client that re-serialises its history differently misses the memo and
//! gets the same canonical hashes the slow way. The seed is random per process, and the table
//! is keyed by tenant, so a collision, accidental or crafted, could only ever mix one tenant's
//! own conversations; the table is bounded and emptied when full.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Mutex, PoisonError};

/// A random value without a dependency for it: std's per-process hash keys.
fn random_seed() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::hash::{canonical_chain_step, CanonicalError, ChainHash, TenantId};

/// Entries kept at most before the table is emptied (about 20 MB).
pub const MEMO_CAPACITY: usize = 1 << 18;

/// Entries allowed per session the store may hold ([`ChainMemo::for_sessions`]): a long
/// conversation's messages.
pub const ENTRIES_PER_SESSION: usize = 256;

/// Entries allowed however small the store (a few conversations' worth).
pub const MIN_CAPACITY: usize = 4096;

/// Remembered chain hashes, shared by every request of the process.
#[derive(Debug)]
pub struct ChainMemo {
    /// The first fingerprint's seed, random per process.
    seed: u64,
    /// Keyed by fingerprints that are already random: hashed with foldhash, not SipHash (a
    /// lookup per message of every request).
    table: Mutex<HashMap<(TenantId, u64), ChainHash, foldhash::fast::RandomState>>,
    capacity: usize,
}

impl Default for ChainMemo {
    fn default() -> Self {
        ChainMemo::with_capacity(MEMO_CAPACITY)
    }
}

impl ChainMemo {
    /// An empty memo sized to a store of `max_sessions` sessions: [`ENTRIES_PER_SESSION`]
    /// each, at least [`MIN_CAPACITY`], at most [`MEMO_CAPACITY`]. Hashes of conversations
    /// the store no longer holds are worth little: a small store gets a small memo.
    pub fn for_sessions(max_sessions: usize) -> ChainMemo {
        ChainMemo::with_capacity(
            max_sessions
                .saturating_mul(ENTRIES_PER_SESSION)
                .clamp(MIN_CAPACITY, MEMO_CAPACITY),
        )
    }

    /// An empty memo holding at most `capacity` hashes.
    pub fn with_capacity(capacity: usize) -> ChainMemo {
        ChainMemo {
            seed: random_seed(),
            table: Mutex::new(HashMap::default()),
            capacity,
        }
    }

    /// The chain hashes of `messages` for `tenant`, exactly as [`super::hash::chain`] computes
    /// them, reusing those remembered for the same bytes.
    pub fn chain(
        &self,
        tenant: &TenantId,
        messages: &[&str],
    ) -> Result<Vec<ChainHash>, CanonicalError> {
        let mut prints = Vec::with_capacity(messages.len());
        let mut print = 0u64;
        for message in messages {
            print = xxh3_64_with_seed(message.as_bytes(), self.seed ^ print.rotate_left(17));
            prints.push(print);
        }
        let mut hashes = Vec::with_capacity(messages.len());
        {
            let table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            for print in &prints {
                match table.get(&(*tenant, *print)) {
                    Some(h) => hashes.push(*h),
                    None => break,
                }
            }
        }
        let known = hashes.len();
        let mut buf = Vec::new();
        let mut h = hashes
            .last()
            .copied()
            .unwrap_or_else(|| ChainHash::start(tenant));
        for message in &messages[known..] {
            h = canonical_chain_step(&h, message, &mut buf)?;
            hashes.push(h);
        }
        if known < hashes.len() {
            let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            if table.len() + (hashes.len() - known) > self.capacity {
                table.clear();
            }
            for (print, h) in prints[known..].iter().zip(&hashes[known..]) {
                table.insert((*tenant, *print), *h);
            }
        }
        Ok(hashes)
    }

    /// Hashes remembered.
    pub fn len(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Hashes it holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Session ids remembered by the bytes they were derived from.
///
/// A session id without a header is derived from the conversation's opening, through the
/// model's first reply ([`super::hash::derived_session_ids`]: canonical JSON and SHA-256 over
/// the messages), and, once there is a reply, settled by a claim in the store. An agent's
/// opening holds its instructions and project files (tens of kilobytes), sent again with
/// every request: so the settled id is remembered under a fingerprint of those messages' raw
/// bytes (XXH3, random seed per process), for that tenant, and the next request pays one
/// fast fingerprint instead of a parse, a digest and a store call. An id the store could not
/// settle is not remembered. Bounded, and emptied when full.
#[derive(Debug)]
pub struct SessionIdMemo {
    seed: u64,
    table: Mutex<HashMap<(TenantId, u64), String, foldhash::fast::RandomState>>,
    capacity: usize,
}

impl SessionIdMemo {
    /// An empty memo for a store of `max_sessions` sessions (one id each, at least
    /// [`MIN_CAPACITY`], at most [`MEMO_CAPACITY`]).
    pub fn for_sessions(max_sessions: usize) -> SessionIdMemo {
        SessionIdMemo {
            seed: random_seed(),
            table: Mutex::new(HashMap::default()),
            capacity: max_sessions.clamp(MIN_CAPACITY, MEMO_CAPACITY),
        }
    }

    /// The fingerprint of `messages` (each one's length and bytes).
    pub fn print(&self, messages: &[&str]) -> u64 {
        messages.iter().fold(self.seed, |print, message| {
            xxh3_64_with_seed(
                message.as_bytes(),
                print.rotate_left(17) ^ message.len() as u64,
            )
        })
    }

    /// The id remembered for `print` of `tenant`'s messages.
    pub fn get(&self, tenant: &TenantId, print: u64) -> Option<String> {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(*tenant, print))
            .cloned()
    }

    /// Remembers `id` for `print` of `tenant`'s messages.
    pub fn insert(&self, tenant: &TenantId, print: u64, id: String) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= self.capacity {
            table.clear();
        }
        table.insert((*tenant, print), id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::hash::chain;

    fn messages(n: usize, tag: &str) -> Vec<String> {
        (0..n)
            .map(|i| format!(r#"{{"role":"user","content":"{tag} {i} \n \"q\""}}"#))
            .collect()
    }

    fn refs(owned: &[String]) -> Vec<&str> {
        owned.iter().map(String::as_str).collect()
    }

    #[test]
    fn remembered_hashes_are_the_chain_hashes() {
        let memo = ChainMemo::default();
        let t = TenantId::from_credential("k");
        let owned = messages(30, "a");
        let all = refs(&owned);
        // First the history up to 20, then the whole of it: the second call reuses 20.
        assert_eq!(
            memo.chain(&t, &all[..20]).unwrap(),
            chain(&t, &all[..20]).unwrap()
        );
        assert_eq!(memo.len(), 20);
        assert_eq!(memo.chain(&t, &all).unwrap(), chain(&t, &all).unwrap());
        assert_eq!(memo.len(), 30);
        // Same again: nothing new to remember.
        assert_eq!(memo.chain(&t, &all).unwrap(), chain(&t, &all).unwrap());
        assert_eq!(memo.len(), 30);
    }

    #[test]
    fn an_edited_message_or_another_tenant_is_hashed_afresh() {
        let memo = ChainMemo::default();
        let t = TenantId::from_credential("k");
        let owned = messages(10, "a");
        let all = refs(&owned);
        memo.chain(&t, &all).unwrap();
        // The same length, one byte different, in the middle: the hashes from there on change.
        let mut edited = owned.clone();
        edited[4] = edited[4].replace("a 4", "b 4");
        let edited_refs = refs(&edited);
        let got = memo.chain(&t, &edited_refs).unwrap();
        assert_eq!(got, chain(&t, &edited_refs).unwrap());
        assert_eq!(got[..4], chain(&t, &all).unwrap()[..4]);
        assert_ne!(got[4], chain(&t, &all).unwrap()[4]);
        // A re-serialisation of the same messages misses the memo but hashes alike.
        let spaced: Vec<String> = owned.iter().map(|m| m.replace(':', " : ")).collect();
        assert_eq!(
            memo.chain(&t, &refs(&spaced)).unwrap(),
            chain(&t, &all).unwrap()
        );
        let other = TenantId::from_credential("other");
        assert_eq!(
            memo.chain(&other, &all).unwrap(),
            chain(&other, &all).unwrap()
        );
    }

    #[test]
    fn the_table_is_bounded() {
        let memo = ChainMemo::with_capacity(25);
        let t = TenantId::from_credential("k");
        for tag in ["a", "b", "c"] {
            let owned = messages(10, tag);
            memo.chain(&t, &refs(&owned)).unwrap();
            assert!(memo.len() <= 25, "{}", memo.len());
        }
        assert!(memo.chain(&t, &["not json"]).is_err());
    }

    #[test]
    fn the_memo_stays_within_its_capacity_under_many_conversations() {
        let memo = ChainMemo::for_sessions(10);
        assert_eq!(memo.capacity(), MIN_CAPACITY);
        assert_eq!(
            ChainMemo::for_sessions(100).capacity(),
            100 * ENTRIES_PER_SESSION
        );
        assert_eq!(
            ChainMemo::for_sessions(usize::MAX).capacity(),
            MEMO_CAPACITY
        );
        let t = TenantId::from_credential("k");
        for c in 0..200 {
            let owned = messages(50, &format!("conversation {c}"));
            memo.chain(&t, &refs(&owned)).unwrap();
            assert!(memo.len() <= memo.capacity(), "{} held", memo.len());
        }
    }

    #[test]
    fn session_ids_are_remembered_per_tenant_and_bytes() {
        let memo = SessionIdMemo::for_sessions(10);
        let t = TenantId::from_credential("k");
        let owned = messages(3, "a");
        let all = refs(&owned);
        let print = memo.print(&all);
        assert_eq!(memo.get(&t, print), None);
        memo.insert(&t, print, "abc".into());
        assert_eq!(memo.get(&t, print).as_deref(), Some("abc"));
        // Another tenant, another message, or the same bytes cut elsewhere: not the same.
        assert_eq!(memo.get(&TenantId::from_credential("other"), print), None);
        assert_ne!(memo.print(&all[..2]), print);
        let joined = format!("{}{}", all[0], all[1]);
        assert_ne!(memo.print(&[joined.as_str(), all[2]]), print);
    }

    #[test]
    fn a_full_session_id_memo_starts_over() {
        let memo = SessionIdMemo::for_sessions(0);
        let t = TenantId::from_credential("k");
        for i in 0..MIN_CAPACITY as u64 {
            memo.insert(&t, i, i.to_string());
        }
        assert_eq!(memo.get(&t, 0).as_deref(), Some("0"));
        memo.insert(&t, u64::MAX, "last".into());
        assert_eq!(memo.get(&t, 0), None, "emptied when full");
        assert_eq!(memo.get(&t, u64::MAX).as_deref(), Some("last"));
    }
}
