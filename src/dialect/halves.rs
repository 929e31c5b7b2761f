//! A long conversation array read by two cores: while the request's thread reads the front
//! half, a helper thread reads the back half from a guessed element start, and the front's
//! reader, which knows the array's structure, vouches for the guess when it gets there.
//!
//! Reading (weighing every message) is most of what compactor adds to a large new request,
//! and while one request is being read the machine's other cores are often idle: one request
//! at a time, half the read is off the latency. The guess is an element start found by bytes
//! alone (`}`, `,`, `{` with only blanks between, past the middle), which a string may also
//! hold; so the helper's elements are taken only when the front's reader stops exactly there,
//! and otherwise the front's reader carries on alone, as if there had been no helper. Either
//! way the answer is the one reader's, byte for byte. One helper serves the process: a
//! request that finds it busy (another request's back half) reads alone, so under load the
//! split costs nothing and the helper never queues work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use rayon_core::{ThreadPool, ThreadPoolBuilder};
use serde::Deserialize;

use super::scan_memo::FastRead;
use super::split::{
    read_array_after, read_array_until, read_elements, skip_ws, Reached, Read, Until,
};
use super::DialectError;
use crate::estimate::Counts;

/// Bytes of the array left to read from which the back half goes to the helper: below it the
/// handoff (waking the helper, a few microseconds with a core idle) is not worth its half.
pub(crate) const MIN_BYTES: usize = 64 * 1024;

/// Where the back half starts, in percent of what is left to read: the helper reads more
/// slowly than the request's thread (the body is in the other core's cache, and the helper
/// may have to wake), about 0.6 times as fast here, so its half is the smaller.
const FRONT_PERCENT: usize = 60;

/// How far past the middle an element start is looked for.
const SEARCH_BYTES: usize = 64 * 1024;

/// Output marks found by a fast reader, by the address of their element, in the array's order.
pub(crate) type Marked = Vec<(usize, u32)>;

/// An array as [`read_array_after`] answers it.
#[allow(clippy::type_complexity)]
pub(crate) type Array<'a> = (Option<(Vec<&'a str>, Vec<Counts>)>, usize);

/// How an array was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Split {
    /// By one thread: too short, no helper (busy, or a single core), or no element start
    /// found past the middle.
    Alone,
    /// In halves, the helper's half taken.
    Joined,
    /// The helper read from a guess the front's reader did not land on (or its half failed):
    /// the front's reader read the rest.
    Discarded,
}

/// [`read_array_after`] of a conversation (`T` for what `fast` leaves to serde), with the
/// marks `fast` found, reading the back half on the helper when `min_bytes` or more are left
/// to read after `known`.
pub(crate) fn read<'a, T, F>(
    text: &'a str,
    fast: F,
    known: Option<Read<'a, Counts>>,
    min_bytes: usize,
) -> Result<(Array<'a>, Marked, Split), DialectError>
where
    T: Deserialize<'a> + Into<Counts>,
    F: Fn(&'a str) -> Option<FastRead> + Copy + Send,
{
    let mut marked = Marked::new();
    let from = known.as_ref().map_or(0, |k| k.2);
    let left = text.len().saturating_sub(from);
    let plan = if left >= min_bytes {
        let guess = from + left / 100 * FRONT_PERCENT;
        Helper::take().and_then(|h| Some((h, element_start(text.as_bytes(), guess)?)))
    } else {
        None
    };
    let Some((helper, split)) = plan else {
        let read = read_array_after::<T, Counts>(text, marking(fast, &mut marked), known)?;
        return Ok((read, marked, Split::Alone));
    };

    let stop = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let mut back = None;
    let mut back_marked = Marked::new();
    let started = Instant::now();
    let front = helper.pool.in_place_scope(|scope| {
        let (back, back_marked, stop, done) = (&mut back, &mut back_marked, &stop, &done);
        scope.spawn(move |_| {
            let (mut elements, mut values) = (Vec::new(), Vec::new());
            let reached = read_elements::<T, Counts>(
                text,
                split,
                &mut marking(fast, back_marked),
                &mut elements,
                &mut values,
                usize::MAX,
                Some(stop),
            );
            *back = Some(reached.map(|r| (elements, values, r)));
            done.store(true, Ordering::Release);
        });
        let front = read_array_until::<T, Counts>(text, marking(fast, &mut marked), known, split);
        if !matches!(&front, Ok(Until::At((_, _, at))) if *at == split) {
            stop.store(true, Ordering::Relaxed);
        }
        // The scope's end would put this thread to sleep until the helper is done, and
        // waking it costs more (~20 µs here) than the helper usually has left: wait awake,
        // for at most as long again as the front took.
        let front_took = started.elapsed();
        while !done.load(Ordering::Acquire) && started.elapsed() < front_took * 2 {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
        front
    });
    drop(helper);

    let (mut elements, mut values, at) = match front? {
        // The array ended before the guess: read whole by the front's reader.
        Until::Done(read, len) => return Ok(((read, len), marked, Split::Discarded)),
        Until::At(read) => read,
    };
    if at == split {
        if let Some(Ok((e, v, Reached::End(len)))) = back {
            elements.extend(e);
            values.extend(v);
            marked.extend(back_marked);
            return Ok(((Some((elements, values)), len), marked, Split::Joined));
        }
    }
    // On from where the front's reader stopped, alone.
    let known = match elements.last() {
        Some(last) => {
            let end = last.as_ptr() as usize - text.as_ptr() as usize + last.len();
            Some((elements, values, end))
        }
        None => None,
    };
    let read = match known {
        Some(known) => {
            read_array_after::<T, Counts>(text, marking(fast, &mut marked), Some(known))?
        }
        None => read_array_after::<T, Counts>(text, marking(fast, &mut marked), None)?,
    };
    Ok((read, marked, Split::Discarded))
}

/// `fast` keeping the marks it finds in `marked`.
fn marking<'a, 'm, F>(
    fast: F,
    marked: &'m mut Marked,
) -> impl FnMut(&'a str) -> Option<(Counts, usize)> + 'm
where
    F: Fn(&'a str) -> Option<FastRead> + 'm,
{
    move |element| {
        let (counts, len, marks) = fast(element)?;
        if let Some(marks) = marks {
            marked.push((element.as_ptr() as usize, marks));
        }
        Some((counts, len))
    }
}

/// The first offset at or after `from` (within [`SEARCH_BYTES`]) that looks like the start of
/// an array element after another: a `{` after a `}` and a `,`, with only blanks between.
fn element_start(b: &[u8], from: usize) -> Option<usize> {
    let window = b.get(from..b.len().min(from.saturating_add(SEARCH_BYTES)))?;
    memchr::memchr_iter(b'}', window).find_map(|close| {
        let comma = skip_ws(b, from + close + 1);
        if b.get(comma) != Some(&b',') {
            return None;
        }
        let open = skip_ws(b, comma + 1);
        (b.get(open) == Some(&b'{')).then_some(open)
    })
}

/// The helper, held by one request at a time.
struct Helper {
    pool: &'static ThreadPool,
}

/// Whether a request holds the helper.
static BUSY: AtomicBool = AtomicBool::new(false);

impl Helper {
    /// The helper, unless another request holds it or there is no second core to run it
    /// (or its thread could not be started).
    fn take() -> Option<Helper> {
        static POOL: OnceLock<Option<ThreadPool>> = OnceLock::new();
        let pool = POOL
            .get_or_init(|| {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                if cores < 2 {
                    return None;
                }
                ThreadPoolBuilder::new()
                    .num_threads(1)
                    .thread_name(|_| "compactor-halves".to_owned())
                    .build()
                    .ok()
            })
            .as_ref()?;
        BUSY.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        Some(Helper { pool })
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        BUSY.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::split::value_len;
    use proptest::prelude::*;
    use serde::de::IgnoredAny;

    /// What serde reads when the fast reader declines: the element's counts are its
    /// `IgnoredAny` (so they differ from the fast reader's, and a mix-up shows).
    struct Slow;

    impl<'de> Deserialize<'de> for Slow {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            IgnoredAny::deserialize(d).map(|_| Slow)
        }
    }

    impl From<Slow> for Counts {
        fn from(_: Slow) -> Counts {
            Counts { text: 1, images: 7 }
        }
    }

    /// A fast reader for objects whose first key is `"role"`: its length as its weight, and
    /// marks from its length; anything else is left to serde.
    fn fast(element: &str) -> Option<FastRead> {
        if !element.starts_with("{\"role\"") {
            return None;
        }
        let len = value_len(element).ok()?;
        Some((
            Counts {
                text: len,
                images: 0,
            },
            len,
            Some(len as u32 % 5),
        ))
    }

    /// A result in plain terms: element offsets, counts, the array's length, marks by offset.
    type Plain = (
        Vec<(usize, usize)>,
        Vec<(usize, usize)>,
        usize,
        Vec<(usize, u32)>,
    );

    fn plain(
        text: &str,
        read: Result<(Array<'_>, Marked, Split), DialectError>,
    ) -> Result<Plain, String> {
        let ((read, len), marked, _) = read.map_err(|e| e.to_string())?;
        let base = text.as_ptr() as usize;
        let (elements, counts) = read.unwrap_or_default();
        Ok((
            elements
                .iter()
                .map(|e| (e.as_ptr() as usize - base, e.len()))
                .collect(),
            counts.iter().map(|c| (c.text, c.images)).collect(),
            len,
            marked.into_iter().map(|(at, m)| (at - base, m)).collect(),
        ))
    }

    /// Reads `text` alone and in halves (retrying while another test holds the helper), and
    /// answers both and how the halves went.
    fn both(text: &str, known: usize) -> (Result<Plain, String>, Result<Plain, String>, Split) {
        let known_of = || {
            if known == 0 {
                return None;
            }
            let ((read, _), _, _) = read::<Slow, _>(text, fast, None, usize::MAX).ok()?;
            let (mut elements, mut counts) = read?;
            elements.truncate(known);
            counts.truncate(known);
            let last = elements.last()?;
            let end = last.as_ptr() as usize - text.as_ptr() as usize + last.len();
            Some((elements, counts, end))
        };
        let alone = plain(text, read::<Slow, _>(text, fast, known_of(), usize::MAX));
        let from = known_of().map_or(0, |k| k.2);
        let guess = element_start(text.as_bytes(), from + (text.len() - from) / 2);
        for _ in 0..10_000 {
            let halves = read::<Slow, _>(text, fast, known_of(), 0);
            let split = halves.as_ref().map_or(Split::Discarded, |h| h.2);
            if split != Split::Alone || guess.is_none() {
                return (alone, plain(text, halves), split);
            }
        }
        panic!("the helper stayed busy");
    }

    fn message(i: usize, content: &str) -> String {
        match i % 3 {
            0 => format!(
                "{{\"role\": \"user\", \"content\": {}}}",
                serde_json::json!(content)
            ),
            1 => format!(
                "{{ \"content\": {}, \"role\": \"assistant\" }}",
                serde_json::json!(content)
            ),
            _ => format!(
                "{{\"role\":\"tool\",\"content\":[{{\"type\":\"text\",\"text\":{}}}]}}",
                serde_json::json!(content)
            ),
        }
    }

    fn array(contents: &[String], sep: &str) -> String {
        let messages: Vec<String> = contents
            .iter()
            .enumerate()
            .map(|(i, c)| message(i, c))
            .collect();
        format!("[{}], \"model\": \"m\"}}", messages.join(sep))
    }

    #[test]
    fn the_back_half_is_joined_when_the_guess_is_an_element_start() {
        let contents: Vec<String> = (0..200)
            .map(|i| format!("message {i} ").repeat(40))
            .collect();
        let text = array(&contents, ", ");
        let (alone, halves, split) = both(&text, 0);
        assert_eq!(split, Split::Joined);
        assert_eq!(halves, alone);
        let (elements, _, len, _) = alone.expect("the array reads");
        assert_eq!(elements.len(), 200);
        assert_eq!(&text[len..], ", \"model\": \"m\"}");
    }

    #[test]
    fn a_guess_inside_a_string_is_discarded_and_the_answer_is_the_same() {
        // Every text ends in `},{`: past the middle, the first `}`, `,`, `{` is in a string.
        let contents: Vec<String> = (0..200)
            .map(|i| format!("{}}},{{", "x".repeat(300 + i)))
            .collect();
        let text = array(&contents, ",");
        let guess = element_start(text.as_bytes(), text.len() / 2).expect("a guess");
        assert_eq!(
            text.as_bytes()[guess + 1],
            b'"',
            "the guess is a string's `{{` before its close"
        );
        let (alone, halves, split) = both(&text, 0);
        assert_eq!(split, Split::Discarded);
        assert_eq!(halves, alone);
    }

    #[test]
    fn a_fault_in_the_back_half_is_the_one_reader_s_error() {
        let contents: Vec<String> = (0..200)
            .map(|i| format!("message {i} ").repeat(40))
            .collect();
        let mut text = array(&contents, ", ");
        // The last element's object left unclosed.
        let end = text.find("], \"model\"").expect("the array's end");
        text.replace_range(end - 1..end, " ");
        let (alone, halves, split) = both(&text, 0);
        assert!(alone.is_err());
        assert_eq!(halves, alone);
        assert_eq!(split, Split::Discarded);
    }

    #[test]
    fn after_known_elements_only_the_rest_is_split() {
        let contents: Vec<String> = (0..300).map(|i| format!("turn {i} ").repeat(40)).collect();
        let text = array(&contents, ",\n  ");
        let (alone, halves, split) = both(&text, 120);
        assert_eq!(split, Split::Joined);
        assert_eq!(halves, alone);
        assert_eq!(alone.expect("the array reads").0.len(), 300);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever the texts (braces, commas, quotes, escapes, blanks) and separators, the
        /// halves answer what one reader does.
        #[test]
        fn halves_answer_what_one_reader_does(
            contents in proptest::collection::vec("[a-z{},\\[\\]\" \\\\\n]{0,80}", 1..60),
            sep in prop_oneof![Just(","), Just(", "), Just(",\n    "), Just(" ,")],
            known in 0usize..30,
        ) {
            let text = array(&contents, sep);
            let (alone, halves, _) = both(&text, known.min(contents.len().saturating_sub(1)));
            prop_assert_eq!(halves, alone);
        }
    }
}
