//! Conversation arrays of recent requests, remembered by their bytes, so that the next request
//! of a conversation reads only the messages it adds.
//!
//! Agents send the whole conversation on every call: the same bytes as last time, new
//! messages at the end. Reading it (finding each message, weighing every string for the token
//! estimate) is most of what inspecting a long request costs. [`ScanMemo`] keeps, per
//! conversation, the bytes of the array read last (from its `[` to the end of its last
//! element) with each element's place and counts. A request whose array starts with exactly
//! those bytes (compared, not hashed: a match is certain, whatever the bytes) takes those
//! elements as read and reads on from there; anything else is read in full, as without the
//! memo. An element's counts depend on its bytes alone, so the answer is the same either way.
//!
//! Entries are found by a fingerprint of the array's first [`KEY_BYTES`] bytes under a scope
//! (the tenant), so one tenant's requests never compare against another's. Conversations that
//! open alike (one system prompt, many tasks) share a bucket of at most [`BUCKET`] entries; a
//! comparison stops at the first differing byte. An entry holds a slice of its request's body
//! (shared, not copied), and the bodies held (with each element's figures) count against the
//! memo's budget (a quarter of `store.max_bytes`, within [`MIN_BUDGET`]..=[`BUDGET`]): when it would be
//! exceeded the table is emptied, as the chain-hash memo does.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use serde::Deserialize;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::outputs::marks;
use super::split::{read_array_after, Read};
use super::{DialectError, DialectKind};
use crate::estimate::Counts;

/// Bytes of an array's start that find its entries. Shorter arrays are not remembered: they
/// cost little to read, and their start changes as they grow.
pub const KEY_BYTES: usize = 512;

/// Entries kept per fingerprint (conversations that open with the same bytes).
pub const BUCKET: usize = 8;

/// Request bodies the memo may hold at most, in bytes, before it is emptied
/// ([`ScanMemo::with_budget`] sizes it to the store).
pub const BUDGET: usize = 64 << 20;

/// Bytes the memo may hold however small the store.
pub const MIN_BUDGET: usize = 4 << 20;

/// Remembered conversation arrays, shared by every request of the process.
#[derive(Debug)]
pub struct ScanMemo {
    /// Random per process: fingerprints cannot be chosen to collide from outside.
    seed: u64,
    table: Mutex<Table>,
    /// What its entries may hold, in bytes (bodies and the per-element figures).
    budget: usize,
}

#[derive(Debug, Default)]
struct Table {
    entries: HashMap<([u8; 16], u64), Vec<Arc<Known>>, foldhash::fast::RandomState>,
    /// Body bytes the entries keep alive.
    held: usize,
}

/// One array as read: its bytes up to the end of its last element, and each element's place
/// (from the `[`) and counts.
#[derive(Debug)]
struct Known {
    bytes: Bytes,
    spans: Vec<(u32, u32)>,
    counts: Vec<Counts>,
    /// Each element's output marks ([`marks`]).
    marks: Vec<u32>,
    /// What keeping it costs: the whole body `bytes` is a slice of, and the figures above.
    held: usize,
}

impl Default for ScanMemo {
    fn default() -> Self {
        ScanMemo::with_budget(BUDGET)
    }
}

impl ScanMemo {
    /// An empty memo holding at most `budget` bytes (at least [`MIN_BUDGET`], at most
    /// [`BUDGET`]). The pipeline gives it a quarter of `store.max_bytes`: the bodies it holds
    /// are mostly the latest requests the store holds too (the same buffers), and the rest
    /// is bounded by that quarter.
    pub fn with_budget(budget: usize) -> ScanMemo {
        // A random value without a dependency for it: std's per-process hash keys.
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        ScanMemo {
            seed,
            table: Mutex::new(Table::default()),
            budget: budget.clamp(MIN_BUDGET, BUDGET),
        }
    }

    /// Bytes it may hold.
    pub fn budget(&self) -> usize {
        self.budget
    }
}

/// A request's use of the memo: the memo, the request's body (entries keep slices of it), the
/// scope its entries live under, and where the scan says what the memo did for it.
#[derive(Debug, Clone, Copy)]
pub struct Remembering<'m> {
    pub memo: &'m ScanMemo,
    pub body: &'m Bytes,
    pub scope: [u8; 16],
    pub used: &'m MemoUse,
}

/// What the memo did for one request, for the counterfactual cost's repeat check (the
/// pipeline's), which need not hash what the memo vouches for. Atomics only because the
/// request's future is `Send`: one request writes them, then reads them.
#[derive(Debug, Default)]
pub struct MemoUse {
    /// Leading elements taken from the memo: byte for byte those of an earlier request of the
    /// scope.
    pub known: AtomicUsize,
    /// Whether the memo now holds the request's array, so the next request of its
    /// conversation will find its elements there.
    pub held: AtomicBool,
}

impl ScanMemo {
    fn key(&self, scope: &[u8; 16], text: &str) -> Option<([u8; 16], u64)> {
        let start = text.as_bytes().get(..KEY_BYTES)?;
        Some((*scope, xxh3_64_with_seed(start, self.seed ^ xxh3_64(scope))))
    }

    /// The remembered array that `text` shares the most elements with from its start (all of
    /// them when `text` starts with its bytes; fewer when a later element was edited or
    /// replaced, as a conversation's last turn may be), and those elements as slices of
    /// `text`.
    fn find<'a>(&self, key: &([u8; 16], u64), text: &'a str) -> Option<(Arc<Known>, Vec<&'a str>)> {
        let bucket: Vec<Arc<Known>> = {
            let table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
            table.entries.get(key)?.clone()
        };
        bucket
            .into_iter()
            .map(|k| {
                let shared = k.shared(text);
                (k, shared)
            })
            .filter(|(_, shared)| !shared.is_empty())
            .max_by_key(|(k, shared)| (shared.len(), k.bytes.len()))
    }

    /// Remembers the array `elements` were read from, replacing `extended` (the entry it
    /// grew from), and answers whether the memo holds it. Nothing when the array is not a
    /// slice of `body`, `body` takes more than a bucket's share of the budget (not held), or
    /// the array adds nothing to `extended` (held already).
    fn remember(
        &self,
        key: ([u8; 16], u64),
        body: &Bytes,
        text: &str,
        (elements, counts, marks): &Conversation<'_>,
        extended: Option<&(Arc<Known>, usize)>,
    ) -> bool {
        // Nothing new: the array is the remembered one (or a prefix of it).
        let same = extended
            .is_some_and(|(k, shared)| *shared == k.spans.len() && k.spans.len() >= elements.len());
        if same {
            return true;
        }
        if body.len() > self.budget / BUCKET {
            return false;
        }
        let Some(last) = elements.last() else {
            return false;
        };
        let origin = text.as_ptr() as usize;
        let offset = |s: &str| (s.as_ptr() as usize).checked_sub(origin);
        let Some(end) = offset(last).map(|at| at + last.len()) else {
            return false;
        };
        let Some(start) = origin.checked_sub(body.as_ptr() as usize) else {
            return false;
        };
        if start.checked_add(end).is_none_or(|stop| stop > body.len()) {
            return false;
        }
        // Sized up front: collected through `Option`, the vector grew from nothing.
        let mut spans = Vec::with_capacity(elements.len());
        for e in elements {
            let at = offset(e).and_then(|at| u32::try_from(at).ok());
            let (Some(at), Ok(len)) = (at, u32::try_from(e.len())) else {
                return false;
            };
            spans.push((at, len));
        }
        let figures = spans.len()
            * (std::mem::size_of::<(u32, u32)>()
                + std::mem::size_of::<Counts>()
                + std::mem::size_of::<u32>());
        let known = Arc::new(Known {
            bytes: body.slice(start..start + end),
            spans,
            counts: counts.to_vec(),
            marks: marks.to_vec(),
            held: body.len() + figures,
        });
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.held + known.held > self.budget {
            table.entries.clear();
            table.held = 0;
        }
        let mut freed = 0;
        let bucket = table.entries.entry(key).or_default();
        if let Some((old, _)) = extended {
            if let Some(at) = bucket.iter().position(|k| Arc::ptr_eq(k, old)) {
                freed += bucket.remove(at).held;
            }
        }
        if bucket.len() >= BUCKET {
            freed += bucket.remove(0).held;
        }
        let held = known.held;
        bucket.push(known);
        table.held = table.held + held - freed;
        true
    }
}

/// Bytes compared at a time by [`Known::shared`]: small enough that the elements within them
/// are still in the first-level cache when they are sliced.
const COMPARED: usize = 16 << 10;

/// Elements a request is expected to add after those the memo knows (its new turn): the
/// vectors of known elements and their counts are made with this much room, so that reading
/// the new ones does not copy a 15,000-element vector into a larger one.
const ROOM: usize = 8;

impl Known {
    /// The elements `text` starts with, as slices of `text`: all of them when `text` starts
    /// with its bytes, else those that end before the first differing byte with the byte after
    /// them (their delimiter) the same too. The bytes are compared [`COMPARED`] at a time and
    /// the elements within them sliced right after, while they are in cache: slicing a
    /// 4 MB request's 15,000 elements after comparing it whole read each element's first and
    /// last bytes from memory again.
    fn shared<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let (old, new) = (&self.bytes[..], text.as_bytes());
        let n = old.len().min(new.len());
        let mut elements = Vec::new();
        // `old[..equal]` and `new[..equal]` are the same; `differs` once a byte after them is not.
        let (mut equal, mut differs) = (0, false);
        for &(at, len) in &self.spans {
            let (at, end) = (at as usize, at as usize + len as usize);
            // The element and its delimiter (the array's last element has none here).
            let needed = (end + 1).min(old.len());
            while equal < needed && !differs {
                let to = (equal + COMPARED).min(n);
                if to > equal && old[equal..to] == new[equal..to] {
                    equal = to;
                } else {
                    equal += common_prefix(&old[equal..to], &new[equal..to]);
                    differs = true;
                }
            }
            if equal < needed {
                break;
            }
            if elements.is_empty() {
                // Room for every remembered element and the few a request adds after them.
                elements.reserve(self.spans.len() + ROOM);
            }
            // Never fails: these bytes are the remembered ones, which were text cut here.
            match text.get(at..end) {
                Some(element) => elements.push(element),
                None => break,
            }
        }
        elements
    }
}

/// The length of the longest common prefix of `a` and `b`, compared a block at a time (the
/// blocks as slices, which the compiler turns into `memcmp`): 4 KiB blocks, then 64-byte ones
/// within the first large block that differs, and byte by byte only within the first small
/// one.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut at = 0;
    for block in [4096, 64] {
        while at + block <= n && a[at..at + block] == b[at..at + block] {
            at += block;
        }
    }
    at + a[at..n]
        .iter()
        .zip(&b[at..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// A conversation array as read: each element's slice, counts and output marks.
pub(crate) type Conversation<'a> = (Vec<&'a str>, Vec<Counts>, Vec<u32>);

/// What a dialect's fast reader makes of one element: its counts, its length, and its output
/// marks when the reader found them on the way (else they are searched for in its bytes).
pub(crate) type FastRead = (Counts, usize, Option<u32>);

/// Reads a conversation array of `dialect` at the start of `text` as
/// [`read_array_after`](super::split::read_array_after) does (each element's counts by `fast`,
/// else serde as `T`), after what `memo` remembers of it, and remembers what it read. Each
/// element's output marks ([`marks`]) are found for the elements the memo did not hold,
/// unless `fast` found them.
pub(crate) fn read_conversation<'a, T: Deserialize<'a> + Into<Counts>>(
    dialect: DialectKind,
    text: &'a str,
    mut fast: impl FnMut(&'a str) -> Option<FastRead>,
    memo: Option<&Remembering<'_>>,
) -> Result<(Option<Conversation<'a>>, usize), DialectError> {
    // The marks `fast` found, by the address of their element (in the array's order).
    let mut marked: Vec<(usize, u32)> = Vec::new();
    let mut fast = |element: &'a str| {
        let (counts, len, marks) = fast(element)?;
        if let Some(marks) = marks {
            marked.push((element.as_ptr() as usize, marks));
        }
        Some((counts, len))
    };
    let with_marks = |read: Option<(Vec<&'a str>, Vec<Counts>)>,
                      mut known: Vec<u32>,
                      marked: &[(usize, u32)]| {
        read.map(|(elements, counts)| {
            let from = known.len().min(elements.len());
            known.truncate(from);
            let mut marked = marked.iter().peekable();
            known.extend(elements[from..].iter().map(|e| {
                match marked.next_if(|(at, _)| *at == e.as_ptr() as usize) {
                    Some(&(_, found)) => found,
                    None => marks(dialect, e),
                }
            }));
            (elements, counts, known)
        })
    };
    let Some((m, key)) = memo.and_then(|m| Some((m, m.memo.key(&m.scope, text)?))) else {
        let (read, len) = read_array_after::<T, Counts>(text, &mut fast, None)?;
        return Ok((with_marks(read, Vec::new(), &marked), len));
    };
    let (found, known) = match m.memo.find(&key, text) {
        Some((k, elements)) => {
            let n = elements.len();
            let end = k
                .spans
                .get(n.saturating_sub(1))
                .map_or(0, |&(at, len)| at as usize + len as usize);
            let mut counts = Vec::with_capacity(n + ROOM);
            counts.extend_from_slice(&k.counts[..n]);
            let known: Read<'a, Counts> = (elements, counts, end);
            (Some((k, n)), Some(known))
        }
        None => (None, None),
    };
    m.used.known.store(
        found.as_ref().map_or(0, |(_, shared)| *shared),
        Ordering::Relaxed,
    );
    let (read, len) = read_array_after::<T, Counts>(text, &mut fast, known)?;
    let read = with_marks(
        read,
        found.as_ref().map_or_else(Vec::new, |(k, shared)| {
            let mut marks = Vec::with_capacity(shared + ROOM);
            marks.extend_from_slice(&k.marks[..*shared]);
            marks
        }),
        &marked,
    );
    if let Some(conversation) = &read {
        let held = m
            .memo
            .remember(key, m.body, text, conversation, found.as_ref());
        m.used.held.store(held, Ordering::Relaxed);
    }
    Ok((read, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::{DialectKind, Scan};
    use crate::estimate::LazyEstimator;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// A request of `dialect` holding `turns` (alternating user and assistant, as each
    /// dialect writes them) after a system prompt long enough to key the memo.
    fn body(dialect: DialectKind, turns: &[String]) -> Bytes {
        let system = "You are a careful agent. ".repeat(40);
        let role = |i: usize| if i % 2 == 0 { "user" } else { "assistant" };
        let v = match dialect {
            DialectKind::ChatCompletions => {
                let mut m = vec![json!({"role": "system", "content": system})];
                m.extend(
                    turns
                        .iter()
                        .enumerate()
                        .map(|(i, t)| json!({"role": role(i), "content": t})),
                );
                json!({"model": "gpt-4o", "messages": m, "stream": true})
            }
            DialectKind::Messages => {
                let mut m =
                    vec![json!({"role": "user", "content": [{"type": "text", "text": system}]})];
                m.extend(turns.iter().enumerate().map(
                    |(i, t)| json!({"role": role(i + 1), "content": [{"type": "text", "text": t}]}),
                ));
                json!({"model": "claude", "max_tokens": 100, "messages": m})
            }
            DialectKind::Responses => {
                let mut m =
                    vec![json!({"type": "message", "role": "developer", "content": system})];
                m.extend(turns.iter().enumerate().map(|(i, t)| {
                    json!({"type": "message", "role": role(i),
                           "content": [{"type": "input_text", "text": t}]})
                }));
                json!({"model": "gpt-5", "input": m, "store": false})
            }
            DialectKind::Gemini => {
                let mut m = vec![json!({"role": "user", "parts": [{"text": system}]})];
                m.extend(turns.iter().enumerate().map(|(i, t)| {
                    let role = if i % 2 == 0 { "model" } else { "user" };
                    json!({"role": role, "parts": [{"text": t}]})
                }));
                json!({"contents": m, "generationConfig": {"maxOutputTokens": 100}})
            }
        };
        Bytes::from(serde_json::to_vec(&v).expect("serialise"))
    }

    /// What a scan says of a request, to compare one made with the memo and one without.
    fn figures(scan: &Scan<'_>) -> (Vec<String>, Vec<usize>, Vec<u32>, usize, usize) {
        (
            scan.messages.iter().map(|m| m.to_string()).collect(),
            scan.message_tokens.clone(),
            scan.marks.clone(),
            scan.fixed_tokens,
            scan.tokens,
        )
    }

    /// Scans `body` with the memo, checks it against a scan without, and answers how many
    /// elements the memo knew beforehand.
    fn scan_both(
        memo: &ScanMemo,
        scope: [u8; 16],
        dialect: DialectKind,
        body: &Bytes,
    ) -> Result<usize, TestCaseError> {
        let est = LazyEstimator::default();
        let known = memo.known(&scope, body);
        let used = MemoUse::default();
        let at = Remembering {
            memo,
            body,
            scope,
            used: &used,
        };
        let with = dialect.scan_remembering(&at, &est).map(|s| figures(&s));
        let without = dialect.scan(body, &est).map(|s| figures(&s));
        // (A body whose array reads but whose messages do not scans to an error.)
        let elements = match (&with, without) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(a, &b);
                Some(a.0.len())
            }
            (Err(a), Err(b)) => {
                prop_assert_eq!(a.to_string(), b.to_string());
                None
            }
            (a, b) => {
                prop_assert!(false, "with the memo {a:?}, without {b:?}");
                None
            }
        };
        // The scan says how many elements it took from the memo (those it knew), and whether
        // the memo now holds them all (the next request's repeat check relies on it).
        prop_assert_eq!(used.known.load(Ordering::Relaxed), known);
        if let (true, Some(elements)) = (used.held.load(Ordering::Relaxed), elements) {
            prop_assert_eq!(memo.known(&scope, body), elements);
        }
        Ok(known)
    }

    impl ScanMemo {
        /// How many leading elements of `body`'s conversation the memo holds.
        fn known(&self, scope: &[u8; 16], body: &Bytes) -> usize {
            let text = std::str::from_utf8(body).expect("utf-8");
            let Some(at) = text
                .find("\"messages\":")
                .or_else(|| text.find("\"input\":"))
            else {
                return 0;
            };
            let array = &text[text[at..].find('[').map_or(0, |i| at + i)..];
            self.key(scope, array)
                .and_then(|key| self.find(&key, array))
                .map_or(0, |(_, shared)| shared.len())
        }
    }

    fn dialects() -> impl Strategy<Value = DialectKind> {
        prop_oneof![
            Just(DialectKind::ChatCompletions),
            Just(DialectKind::Messages),
            Just(DialectKind::Responses),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Breaks if a request read after its conversation's earlier requests scans
        /// differently from the same bytes read afresh, or if the memo is not used.
        #[test]
        fn a_growing_conversation_scans_as_if_read_afresh(
            dialect in dialects(),
            turns in prop::collection::vec("[a-z0-9 \"\\\\\n\té日]{0,80}|\"user\"|tool_result|_call_output", 2..16),
            edit in any::<prop::sample::Index>(),
        ) {
            let memo = ScanMemo::default();
            let scope = [7; 16];
            for k in 1..=turns.len() {
                let known = scan_both(&memo, scope, dialect, &body(dialect, &turns[..k]))?;
                // The system prompt and every turn but the newest: read before (the first
                // request of the conversation finds nothing).
                prop_assert_eq!(known, if k == 1 { 0 } else { k }, "request {}", k);
            }
            // Another tenant's identical request finds nothing.
            prop_assert_eq!(scan_both(&memo, [8; 16], dialect, &body(dialect, &turns))?, 0);
            // An earlier turn edited (a client that rewrites its history): the system prompt
            // and the turns before the edit are taken as read, the rest read afresh, with the
            // same figures.
            let mut edited = turns.clone();
            let i = edit.index(edited.len());
            edited[i].push_str(" (edited)");
            let known = scan_both(&memo, scope, dialect, &body(dialect, &edited))?;
            prop_assert_eq!(known, i + 1, "edit at turn {}", i);
            // Then its last turn replaced (the next turn of an agent that rewrites its latest
            // message): everything before it taken as read (from the edited request, which
            // took the place of the entry it came from), and remembered in place of it, so
            // the one after reads only its own last turn too.
            let mut replaced = edited.clone();
            if let Some(last) = replaced.last_mut() {
                last.push_str(" (replaced)");
            }
            let n = turns.len();
            prop_assert_eq!(scan_both(&memo, scope, dialect, &body(dialect, &replaced))?, n);
            if let Some(last) = replaced.last_mut() {
                last.push_str(" (again)");
            }
            prop_assert_eq!(scan_both(&memo, scope, dialect, &body(dialect, &replaced))?, n);
            // What follows the remembered bytes is still checked.
            let whole = body(dialect, &turns);
            let broken = Bytes::from([&whole[..whole.len() - 2], b"x}".as_slice()].concat());
            scan_both(&memo, scope, dialect, &broken)?;
        }
    }

    /// A conversation several [`COMPARED`] blocks long, edited in the turn that spans each
    /// block boundary, the turns around it, its first and its last: every element before the
    /// edit is taken as read (the comparison goes on from block to block), none after it, and
    /// the scan is the one made afresh.
    #[test]
    fn elements_across_compared_blocks_are_shared_up_to_the_first_edit() {
        let dialect = DialectKind::ChatCompletions;
        let turns: Vec<String> = (0..600)
            .map(|i| format!("turn {i} é ").repeat(12))
            .collect();
        let whole = body(dialect, &turns);
        let array = whole
            .windows(12)
            .position(|w| w == b"\"messages\":[")
            .expect("messages")
            + 11;
        let scan = dialect
            .scan(&whole, &LazyEstimator::default())
            .expect("scan");
        // Each turn's element (after the system prompt) from the array's `[`.
        let spans: Vec<(usize, usize)> = scan.messages[1..]
            .iter()
            .map(|m| {
                let at = m.as_ptr() as usize - whole.as_ptr() as usize - array;
                (at, at + m.len())
            })
            .collect();
        assert!(spans.last().expect("turns").1 > 3 * COMPARED);
        let mut edits = vec![0, turns.len() - 1];
        for boundary in (1..=3).map(|k| k * COMPARED) {
            let i = spans
                .iter()
                .position(|&(_, end)| end >= boundary)
                .expect("a turn across the boundary");
            edits.extend([i - 1, i, i + 1]);
        }
        for i in edits {
            let memo = ScanMemo::default();
            let scope = [3; 16];
            assert_eq!(scan_both(&memo, scope, dialect, &whole).expect("first"), 0);
            let mut edited = turns.clone();
            edited[i].push('!');
            let known = scan_both(&memo, scope, dialect, &body(dialect, &edited)).expect("edited");
            assert_eq!(known, i + 1, "edit in turn {i}, bytes {:?}", spans[i]);
        }
    }

    #[test]
    fn common_prefix_stops_at_the_first_difference_in_any_block() {
        let a: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for differs in [0, 1, 63, 64, 65, 4095, 4096, 4097, 4160, 8191, 9_999] {
            let mut b = a.clone();
            b[differs] ^= 1;
            assert_eq!(common_prefix(&a, &b), differs, "differs at {differs}");
        }
        for len in [0, 1, 64, 100, 4096, 5000, 10_000] {
            assert_eq!(common_prefix(&a, &a[..len]), len);
            assert_eq!(common_prefix(&a[..len], &a), len);
        }
    }

    #[test]
    fn held_bodies_stay_within_the_budget() {
        let memo = ScanMemo::with_budget(8 << 20);
        let budget = memo.budget();
        assert_eq!(budget, 8 << 20);
        let scope = [1; 16];
        let est = LazyEstimator::default();
        let dialect = DialectKind::ChatCompletions;
        // Distinct conversations (their first bytes differ) of `size` bytes.
        let request = |i: usize, size: usize| {
            let turns = vec![format!("task {i}"), "x".repeat(size)];
            let mut v: Value = serde_json::from_slice(&body(dialect, &turns)).expect("json");
            v["messages"][0]["content"] = json!(format!("{i} {}", "system ".repeat(100)));
            Bytes::from(serde_json::to_vec(&v).expect("json"))
        };
        let held = || {
            let table = memo.table.lock().expect("lock");
            let sum: usize = table.entries.values().flatten().map(|k| k.held).sum();
            assert_eq!(table.held, sum);
            sum
        };
        let scan = |b: &Bytes| {
            let used = MemoUse::default();
            let at = Remembering {
                memo: &memo,
                body: b,
                scope,
                used: &used,
            };
            dialect.scan_remembering(&at, &est).expect("scan");
        };
        // A tenth of the budget each: the table is emptied when the next would not fit.
        for i in 0..25 {
            let b = request(i, budget / 10);
            scan(&b);
            let now = held();
            assert!(now <= budget, "{now} held");
            assert!(now >= b.len(), "the latest is kept");
        }
        // A body over a bucket's share of the budget is read, not kept.
        let before = held();
        scan(&request(99, budget / BUCKET + 1));
        assert_eq!(held(), before);
    }
}
