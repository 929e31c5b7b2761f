//! A conversation read while its body is still arriving.
//!
//! A large body comes in several reads of the socket: on loopback a 200 KB one often in two,
//! tens of microseconds apart; across a network a 4 MB one in hundreds, over milliseconds.
//! Reading the conversation (finding each element, weighing its strings) is most of what
//! inspecting a request costs, and it need not wait for the last byte. Between two reads of
//! the body, [`Early::read`] reads the elements that have arrived whole; the scan of the whole
//! body then takes them as read, as it takes those the scan memo knows
//! ([`super::scan_memo`]). They are this body's own bytes, which do not change once received,
//! and an element's counts depend on its bytes alone: the scan answers the same, byte for
//! byte, with or without an early read.
//!
//! The early read starts after the elements the memo knows (the next turn of a long
//! conversation adds a few elements to the thousands the memo holds: those are compared, not
//! read), reads only elements whose delimiter has arrived too (a number cut short would read
//! as a number), and reads on where it stopped. It tries again only once the bytes that
//! arrived since its last try are at least half of what it has not read: a single element
//! arriving in many reads (a 1 MB tool output) is tried a few times, not once per read. It
//! never fails: whatever it cannot read is left to the scan, which says what is wrong.

use std::sync::Arc;

use serde::Deserialize;

use super::outputs::marks;
use super::scan_memo::{from_memo, Known, Prior, ScanMemo, ROOM};
use super::split::{next, object_fields, read_element, skip_ws, Next};
use super::{chat, gemini, messages, responses, DialectError, DialectKind};
use crate::estimate::Counts;

/// What was read of one body's conversation array before the body was whole.
#[derive(Debug)]
pub struct Early {
    dialect: DialectKind,
    /// The memo's scope (the tenant): one tenant's body is never compared with another's.
    scope: [u8; 16],
    /// Where the array's `[` is in the body, once found.
    array: Option<usize>,
    /// The memo's entry the array starts like, and how many of its elements the body has.
    known: Option<(Arc<Known>, usize)>,
    /// The elements read here, after the memo's: each one's place (from the `[`), counts and
    /// output marks.
    spans: Vec<(u32, u32)>,
    counts: Vec<Counts>,
    marks: Vec<u32>,
    /// Where reading goes on (from the `[`): right after the last element known or read, or
    /// right after the `[` when there is none.
    resume: usize,
    /// The body's length at the last try.
    tried: usize,
    /// Nothing more to read here: the array is read to its end, or the body is not what
    /// the early read can read (the scan will say why).
    done: bool,
}

impl Early {
    /// Nothing read yet of a body of `dialect` from the tenant `scope`.
    pub fn new(dialect: DialectKind, scope: [u8; 16]) -> Early {
        Early {
            dialect,
            scope,
            array: None,
            known: None,
            spans: Vec::new(),
            counts: Vec::new(),
            marks: Vec::new(),
            resume: 0,
            tried: 0,
            done: false,
        }
    }

    /// Reads what it can of `body`, the bytes of the body received so far (each call's a
    /// longer prefix of the same body).
    pub fn read(&mut self, memo: &ScanMemo, body: &[u8]) {
        if self.done {
            return;
        }
        let pending = body
            .len()
            .saturating_sub(self.array.map_or(0, |a| a + self.resume));
        if body.len().saturating_sub(self.tried) < pending / 2 {
            return;
        }
        self.tried = body.len();
        let found = self.known.is_some() || !self.spans.is_empty();
        let Some(array) = self.array.filter(|_| found) else {
            // No array yet, or nothing known or read of it (its first element had not
            // arrived whole): look again from the start.
            self.find_array(memo, body);
            return;
        };
        if let (Some((k, n)), true) = (&mut self.known, self.spans.is_empty()) {
            // The memo's match may go on in what arrived since: compared, not read.
            let shared = k.shared_count(&body[array..], *n);
            if let Some(&(at, len)) = k.spans.get(shared.wrapping_sub(1)) {
                *n = shared;
                self.resume = at as usize + len as usize;
            }
        }
        match body.get(array + self.resume..).and_then(whole_chars) {
            Some(tail) => self.read_elements(tail),
            None => self.done = true,
        }
    }

    /// Finds the array (the fields before it must have arrived whole), what the memo knows of
    /// it, and reads on from there.
    fn find_array(&mut self, memo: &ScanMemo, body: &[u8]) {
        let Some(text) = whole_chars(body) else {
            self.done = true;
            return;
        };
        let mut found = None;
        // The callback stops the walk at the array: what follows has not all arrived.
        let _ = object_fields(text, conversation_field(self.dialect), |rest| {
            found = Some(rest);
            Err(DialectError::Malformed { at: 0 })
        });
        let Some(rest) = found else {
            return;
        };
        if !rest.starts_with('[') {
            // `null`, or Responses' `input` as a string: nothing to read ahead.
            self.done = true;
            return;
        }
        let Some(key) = memo.key(&self.scope, rest) else {
            // Too little of the array to look it up in the memo: wait for more.
            return;
        };
        self.array = Some(text.len() - rest.len());
        self.resume = 1;
        self.known = None;
        if let Some((k, elements)) = memo.find(&key, rest) {
            let n = elements.len();
            if let Some(&(at, len)) = k.spans.get(n.wrapping_sub(1)) {
                self.resume = at as usize + len as usize;
                self.known = Some((k, n));
            }
        }
        match rest.get(self.resume..) {
            Some(tail) => self.read_elements(tail),
            None => self.done = true,
        }
    }

    /// Reads the whole elements of `tail`, the array from where reading goes on.
    fn read_elements(&mut self, tail: &str) {
        let b = tail.as_bytes();
        let mut after = self.known.is_some() || !self.spans.is_empty();
        let mut read = 0;
        loop {
            let start = if after {
                match next(b, skip_ws(b, read)) {
                    Ok(Next::Element(start)) => start,
                    Ok(Next::End(_)) => {
                        self.done = true;
                        break;
                    }
                    Err(_) => break,
                }
            } else {
                let start = skip_ws(b, read);
                if b.get(start) == Some(&b']') {
                    self.done = true;
                    break;
                }
                start
            };
            let Some(Ok((counts, len, marks))) =
                tail.get(start..).map(|e| element(self.dialect, e))
            else {
                break;
            };
            // Whole only with its delimiter.
            if !matches!(b.get(skip_ws(b, start + len)), Some(b',' | b']')) {
                break;
            }
            let (Ok(at), Ok(n)) = (u32::try_from(self.resume + start), u32::try_from(len)) else {
                self.done = true;
                break;
            };
            self.spans.push((at, n));
            self.counts.push(counts);
            self.marks.push(marks);
            read = start + len;
            after = true;
        }
        self.resume += read;
    }

    /// What was read, for the scan of the whole `body` reading the array at the start of
    /// `text` (a slice of `body`): `None` when that is not the array read here, or when
    /// nothing was (the memo is then asked again, with the whole body).
    pub(super) fn taken<'a>(
        &self,
        dialect: DialectKind,
        body: &[u8],
        text: &'a str,
    ) -> Option<Prior<'a>> {
        let at = (text.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        if dialect != self.dialect || self.array != Some(at) {
            return None;
        }
        let (found, elements, mut marks) = match &self.known {
            Some((k, n)) => {
                let elements = k.shared(text, *n);
                from_memo(k.clone(), elements, self.spans.len() + ROOM)
            }
            None if self.spans.is_empty() => return None,
            None => (None, None, Vec::with_capacity(self.spans.len() + ROOM)),
        };
        let shared = found.as_ref().map_or(0, |(_, n)| *n);
        let (mut elements, mut counts, mut end) =
            elements.unwrap_or_else(|| (Vec::new(), Vec::new(), 0));
        // Read here after the memo's elements as the body's prefix had them: the whole body
        // cannot share more with the memo when a different element followed them.
        if self.known.as_ref().map_or(0, |(_, n)| *n) == shared && !self.spans.is_empty() {
            elements.reserve(self.spans.len() + ROOM);
            counts.reserve(self.spans.len() + ROOM);
            for &(at, len) in &self.spans {
                let (at, len) = (at as usize, len as usize);
                elements.push(text.get(at..at + len)?);
                end = at + len;
            }
            counts.extend_from_slice(&self.counts);
            marks.extend_from_slice(&self.marks);
        }
        Some((found, Some((elements, counts, end)), marks))
    }
}

/// The field holding a request's conversation.
fn conversation_field(dialect: DialectKind) -> &'static str {
    match dialect {
        DialectKind::ChatCompletions | DialectKind::Messages => "messages",
        DialectKind::Responses => "input",
        DialectKind::Gemini => "contents",
    }
}

/// One element at the start of `rest`, read as its dialect's scan reads it: its counts, its
/// length and its output marks.
fn element(dialect: DialectKind, rest: &str) -> Result<(Counts, usize, u32), DialectError> {
    match dialect {
        DialectKind::ChatCompletions => chat::element(rest),
        DialectKind::Messages => messages::element(rest),
        DialectKind::Responses => responses::element(rest),
        DialectKind::Gemini => gemini::element(rest),
    }
}

/// [`element`] for a dialect whose scan reads elements by `fast`, else by serde as `T`.
pub(super) fn read_with<'a, T: Deserialize<'a> + Into<Counts>>(
    dialect: DialectKind,
    rest: &'a str,
    fast: impl Fn(&'a str) -> Option<super::scan_memo::FastRead>,
) -> Result<(Counts, usize, u32), DialectError> {
    let mut found = None;
    let (counts, len) = read_element::<T, Counts>(rest, &mut |e| {
        let (counts, len, marks) = fast(e)?;
        found = marks;
        Some((counts, len))
    })?;
    let marks = match found {
        Some(marks) => marks,
        None => marks(dialect, rest.get(..len).unwrap_or(rest)),
    };
    Ok((counts, len, marks))
}

/// `bytes` up to the last whole character (the body's last read may end inside one); `None`
/// when they are not UTF-8 before that.
fn whole_chars(bytes: &[u8]) -> Option<&str> {
    match simdutf8::compat::from_utf8(bytes) {
        Ok(text) => Some(text),
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&bytes[..e.valid_up_to()]).ok(),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::dialect::scan_memo::tests::{body, figures};
    use crate::dialect::scan_memo::{MemoUse, Remembering};
    use crate::estimate::LazyEstimator;

    type Figures = (Vec<String>, Vec<usize>, Vec<u32>, usize, usize);

    /// Scans the whole `body` with `memo` and what `early` read of it: the scan's figures (or
    /// its error) and how many elements it took from the memo.
    fn scan(
        memo: &ScanMemo,
        dialect: DialectKind,
        body: &Bytes,
        early: Option<&Early>,
    ) -> (Result<Figures, String>, usize) {
        let used = MemoUse::default();
        let at = Remembering {
            memo,
            body,
            scope: SCOPE,
            used: &used,
            early,
        };
        let scan = dialect
            .scan_remembering(&at, &LazyEstimator::default())
            .map(|s| figures(&s))
            .map_err(|e| e.to_string());
        (scan, used.known.load(Ordering::Relaxed))
    }

    const SCOPE: [u8; 16] = [7; 16];

    fn dialects() -> impl Strategy<Value = DialectKind> {
        prop_oneof![
            Just(DialectKind::ChatCompletions),
            Just(DialectKind::Messages),
            Just(DialectKind::Responses),
            Just(DialectKind::Gemini),
        ]
    }

    /// `body` read by an early read as it arrives, in prefixes ending at `cuts`.
    fn arrive(memo: &ScanMemo, dialect: DialectKind, body: &[u8], cuts: &[usize]) -> Early {
        let mut early = Early::new(dialect, SCOPE);
        for &cut in cuts {
            early.read(memo, &body[..cut.min(body.len())]);
        }
        early
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Breaks if a body read as it arrives, in any pieces (cut inside a character, an
        /// escape, an element or between them), scans differently from the same bytes read
        /// whole, or takes a different number of elements from the memo: with the memo
        /// empty, holding the conversation's previous request, or an edited one; and with a
        /// byte of the body broken.
        #[test]
        fn a_body_read_as_it_arrives_scans_as_the_whole_body(
            dialect in dialects(),
            turns in prop::collection::vec("[a-z0-9 \"\\\\\n\té日]{0,80}|\"user\"|tool_result", 2..14),
            earlier in 0usize..3,
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 1..6),
            broken in any::<Option<prop::sample::Index>>(),
        ) {
            let mut whole = body(dialect, &turns).to_vec();
            if let Some(at) = broken {
                let at = at.index(whole.len());
                whole[at] = b'\xff';
            }
            let whole = Bytes::from(whole);
            let (with_early, without) = (ScanMemo::default(), ScanMemo::default());
            let n = turns.len();
            let before = match earlier {
                0 => None,
                1 => Some(body(dialect, &turns[..n - 1])),
                _ => {
                    let mut edited = turns.clone();
                    edited[n / 2].push_str(" (edited)");
                    Some(body(dialect, &edited))
                }
            };
            for memo in [&with_early, &without] {
                if let Some(before) = &before {
                    scan(memo, dialect, before, None).0.map_err(TestCaseError::fail)?;
                }
            }
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(whole.len())).collect();
            cuts.sort_unstable();
            let early = arrive(&with_early, dialect, &whole, &cuts);
            let read = scan(&with_early, dialect, &whole, Some(&early));
            prop_assert_eq!(&read, &scan(&without, dialect, &whole, None));
            let afresh = dialect
                .scan(&whole, &LazyEstimator::default())
                .map(|s| figures(&s))
                .map_err(|e| e.to_string());
            prop_assert_eq!(read.0, afresh);
        }
    }

    /// A long conversation arriving in 16 KiB pieces is read almost whole before its last
    /// piece, and the scan takes what was read instead of reading it again: counts planted in
    /// the early read show in the scan's figures.
    #[test]
    fn what_was_read_early_is_what_the_scan_takes() {
        let dialect = DialectKind::ChatCompletions;
        let turns: Vec<String> = (0..400).map(|i| format!("turn {i} ").repeat(20)).collect();
        let whole = body(dialect, &turns);
        let cuts: Vec<usize> = (1..whole.len() / 16_384).map(|i| i * 16_384).collect();
        let memo = ScanMemo::default();
        let mut early = arrive(&memo, dialect, &whole, &cuts);
        assert!(early.known.is_none(), "the memo was empty");
        // Every element but those in the last piece: the system prompt and the turns.
        let last = *cuts.last().expect("pieces");
        assert!(
            early.spans.len() > turns.len() * last / whole.len() - 2,
            "{} of {} elements read",
            early.spans.len(),
            turns.len() + 1
        );
        let (afresh, _) = scan(&ScanMemo::default(), dialect, &whole, None);
        let afresh = afresh.expect("scan");
        assert_eq!(
            scan(&memo, dialect, &whole, Some(&early)).0,
            Ok(afresh.clone())
        );
        // Taken, not read again.
        early.counts[3] = Counts::text(0);
        let (planted, _) = scan(&ScanMemo::default(), dialect, &whole, Some(&early));
        let planted = planted.expect("scan");
        assert_ne!(planted.1[3], afresh.1[3]);
        assert_eq!(planted.1[4..], afresh.1[4..]);
    }

    /// The next turn of a remembered conversation: the early read compares what the memo
    /// holds and reads only the new turn; a body whose fields before its conversation have
    /// not all arrived, or whose conversation is not an array, is left to the scan.
    #[test]
    fn the_memo_is_compared_not_read_and_other_shapes_are_left_to_the_scan() {
        let dialect = DialectKind::Messages;
        let turns: Vec<String> = (0..60).map(|i| format!("turn {i} ").repeat(20)).collect();
        let memo = ScanMemo::default();
        scan(&memo, dialect, &body(dialect, &turns[..59]), None)
            .0
            .expect("scan");
        let whole = body(dialect, &turns);
        let early = arrive(&memo, dialect, &whole, &[whole.len() - 3]);
        assert_eq!(early.known.as_ref().map(|(_, n)| *n), Some(60));
        assert_eq!(early.spans.len(), 1, "the new turn only");
        let (read, known) = scan(&memo, dialect, &whole, Some(&early));
        assert_eq!(known, 60);
        assert_eq!(read, scan(&ScanMemo::default(), dialect, &whole, None).0);

        // The conversation after a field still arriving.
        let late = br#"{"system": "a long system prompt", "messages": [{"role": "user", "content": "hi"}]}"#;
        let early = arrive(&memo, dialect, late, &[20]);
        assert_eq!((early.array, early.done), (None, false));
        // Responses' `input` as a string.
        let text = br#"{"model": "gpt-5", "input": "hello there", "store": false}"#;
        let early = arrive(&memo, DialectKind::Responses, text, &[40]);
        assert!(early.done && early.spans.is_empty());
        // Only the array read is taken (a second `messages` is another array).
        let early = arrive(&memo, dialect, &whole, &[whole.len() - 3]);
        let text = std::str::from_utf8(&whole).expect("utf-8");
        let array = text.find("\"messages\":[").expect("messages") + 11;
        assert!(early.taken(dialect, &whole, &text[array..]).is_some());
        assert!(early.taken(dialect, &whole, &text[array + 1..]).is_none());
        assert!(early
            .taken(DialectKind::ChatCompletions, &whole, &text[array..])
            .is_none());
    }
}
