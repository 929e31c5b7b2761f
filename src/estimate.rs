//! Token estimation without a tokenizer (docs/architecture.md, *Token estimate*).
//!
//! compactor estimates the tokens of everything the model reads (message text, tool-call names
//! and arguments, tool outputs, reasoning, the system prompt and tool definitions) from how
//! many characters of each class the text holds, plus a fixed cost per image. A tokenizer
//! splits text at the boundaries between letters, digits, punctuation and whitespace, and
//! common English words are single tokens while each Chinese character is close to one, so a
//! single rate per character is far off for anything but prose: escaped hex dumps and shell
//! listings cost about twice what four characters per token says, CJK text about three times.
//!
//! Each character class has a weight, in hundredths of a token ([`WEIGHT_PER_TOKEN`]), fitted
//! against OpenAI's `o200k_base` tokenizer on prose, code, tool output, hex dumps and Chinese,
//! Japanese and Russian text (`tests/estimate_accuracy.rs` checks every sample is within 15%):
//!
//! | Class | Weight (tokens per character) |
//! |---|---:|
//! | ASCII letters | 0.20 |
//! | spaces and tabs | 0.15 |
//! | line breaks (carrying the indentation after them) | 0.87 |
//! | digits (short numbers are a token each) | 1.00 |
//! | other ASCII: punctuation, symbols, control | 0.43 |
//! | CJK: Chinese, Japanese kana, Korean hangul, fullwidth forms | 0.72 |
//! | every other character (accented Latin, Cyrillic, Greek, emoji, ...) | 0.26 |
//!
//! The weighted sum over a text is its *weight*; a message's weight becomes tokens at the
//! estimator's rate, rounded up per message, so the estimate of a request is the sum of the
//! estimates of its messages plus that of its tool definitions. Dialects count what a message
//! holds into [`Counts`]; this module turns counts into tokens. What a neutral message holds is
//! counted by [`crate::transcript`], which builds on this module.
//!
//! The count is one pass over the bytes with no decoding: each class is recognised from single
//! bytes (a UTF-8 character is counted at its first byte; the first byte says whether it is
//! CJK), counted in byte lanes that vectorise.

/// The default rate: tokens per character at the base weight of 25 hundredths (what English
/// was once estimated at, four characters per token). [`LazyEstimator::new`] takes a rate
/// relative to it, so every class weight scales together.
pub const TOKENS_PER_CHAR: f64 = 0.25;

/// Weight units per token at the default rate: class weights are hundredths of a token.
pub const WEIGHT_PER_TOKEN: usize = 100;

/// Weight of an ASCII letter: English prose is about five characters per `o200k_base` token,
/// a space before a word being part of the word's token.
pub const LETTER_WEIGHT: usize = 20;
/// Weight of a space or tab: most join the word after them; runs of indentation do not.
pub const BLANK_WEIGHT: usize = 15;
/// Weight of a line break (`\n`, `\r`): a line break is its own token, and so usually is the
/// indentation after it, which the break carries here.
pub const NEWLINE_WEIGHT: usize = 87;
/// Weight of a digit: tokenizers split numbers into groups of at most three digits, and the
/// numbers of tool output (sizes, times, line numbers, hex) are short, about a token each.
pub const DIGIT_WEIGHT: usize = 100;
/// Weight of any other ASCII byte (punctuation, symbols, control characters): code, JSON and
/// escapes (`\x4f`, `\"`) break into many short tokens.
pub const SYMBOL_WEIGHT: usize = 43;
/// Weight of a CJK character (a Chinese character, Japanese kana, Korean hangul, CJK
/// punctuation or a fullwidth form): each is close to a token.
pub const CJK_WEIGHT: usize = 72;
/// Weight of any other non-ASCII character: accented Latin, Cyrillic, Greek, emoji and the
/// rest (Russian prose is about four characters per token).
pub const OTHER_WEIGHT: usize = 26;

/// Estimated tokens of one image.
///
/// An image's token cost depends on its size and detail level, which compactor cannot see
/// without downloading or decoding it. 765 is what OpenAI charges for a 1024×1024 image at
/// `detail: high` (85 base tokens + 4 tiles × 170), a common screenshot size; Anthropic's
/// formula (width × height / 750) gives ~1,400 for the same image and caps near 1,600. A
/// fixed value keeps the estimate cheap and deterministic; it errs low for large images,
/// which the trigger ratio's headroom absorbs.
pub const IMAGE_TOKENS: usize = 765;

/// What a message (or any piece of a request) holds, as far as the estimate cares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Weight of the text the model reads ([`text_weight`]).
    pub text: usize,
    /// Images the model sees.
    pub images: usize,
}

impl Counts {
    /// Counts of text of weight `text` and no image.
    pub fn text(text: usize) -> Counts {
        Counts { text, images: 0 }
    }

    /// Adds another count to this one.
    pub fn add(&mut self, other: Counts) {
        self.text = self.text.saturating_add(other.text);
        self.images = self.images.saturating_add(other.images);
    }
}

/// A token estimator from text weights at a fixed rate: cheap enough for every request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LazyEstimator {
    /// Multiplier of every class weight: the rate over [`TOKENS_PER_CHAR`] (1 by default).
    scale: f64,
}

impl Default for LazyEstimator {
    fn default() -> Self {
        LazyEstimator { scale: 1.0 }
    }
}

impl LazyEstimator {
    /// An estimator at a custom rate: `tokens_per_char` over [`TOKENS_PER_CHAR`] scales every
    /// class weight (0.5 doubles every estimate). Non-finite or non-positive rates fall back
    /// to [`TOKENS_PER_CHAR`].
    pub fn new(tokens_per_char: f64) -> Self {
        let tokens_per_char = if tokens_per_char.is_finite() && tokens_per_char > 0.0 {
            tokens_per_char
        } else {
            TOKENS_PER_CHAR
        };
        LazyEstimator {
            scale: tokens_per_char / TOKENS_PER_CHAR,
        }
    }

    /// Tokens of text of weight `weight`, rounded up.
    pub fn weight(&self, weight: usize) -> usize {
        // At the default rate in integers: it runs for every message of every request, and
        // `f64::ceil` is a call into libm on x86-64's baseline (no SSE4.1 rounding), a
        // twentieth of reading a plain chat message. The same result as the float path for
        // any weight below 2^53 (a ratio of integers is never within rounding of the next).
        if self.scale == 1.0 {
            return weight.div_ceil(WEIGHT_PER_TOKEN);
        }
        // `as` saturates at `usize::MAX`.
        (weight as f64 * self.scale / WEIGHT_PER_TOKEN as f64).ceil() as usize
    }

    /// Tokens of a piece of text.
    pub fn text(&self, text: &str) -> usize {
        self.weight(text_weight(text))
    }

    /// Tokens of counted content: the text's plus [`IMAGE_TOKENS`] per image.
    pub fn counts(&self, counts: Counts) -> usize {
        self.weight(counts.text)
            .saturating_add(counts.images.saturating_mul(IMAGE_TOKENS))
    }

    /// The text weight a model that could fit `tokens` tokens would read (inverse of
    /// [`LazyEstimator::weight`], rounded down).
    pub fn weight_for_tokens(&self, tokens: usize) -> usize {
        (tokens as f64 * WEIGHT_PER_TOKEN as f64 / self.scale).floor() as usize
    }
}

/// Bytes per chunk of the escapes' count ([`Escapes::pairs`]) and of [`json_literal_weight`]'s
/// pass over a literal with escapes, counted in `u8` scalars: at most 255 each. Each chunk ends
/// by widening every counter, which at 64 bytes cost a quarter of the count; at 192 it is a
/// few percent (instructions counted under callgrind).
const CHUNK: usize = 192;
const _: () = assert!(CHUNK <= u8::MAX as usize);

/// Bytes the class count's vector loop takes at a time (SSE2's 16 lanes, x86-64's baseline;
/// also a multiple of NEON's and of AVX2's halves). [`CHUNK`] is a multiple of it.
const LANES: usize = 16;
const _: () = assert!(CHUNK % LANES == 0);

/// What [`Classes::count`] pads a text's last block with: a symbol (no class but ASCII counts
/// it, and the count takes the chunk's length for that) above every control character (so
/// the lowest byte still tells whether the text held one).
const PAD: u8 = b'!';

/// Characters of each class in a text (see the module documentation for the classes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Classes {
    letters: usize,
    blanks: usize,
    newlines: usize,
    digits: usize,
    /// Every ASCII byte, symbols being what the other ASCII classes leave.
    ascii: usize,
    /// First bytes of non-ASCII characters.
    non_ascii: usize,
    /// First bytes of CJK characters (a subset of `non_ascii`).
    cjk: usize,
    /// Backslashes (symbols; counted so a JSON string literal free of escapes is known
    /// without another pass).
    backslashes: usize,
}

/// Bytes per chunk of [`Classes::count`]: each of its [`LANES`] byte lanes counts at most one
/// per [`LANES`] bytes, so a lane cannot overflow up to 255 of them.
const LANE_CHUNK: usize = 255 * LANES;

/// The class count's per-lane counters: lane `i` counts the bytes at `i` modulo [`LANES`],
/// which is what a vector register's lanes do, so the compiler keeps each counter in one
/// register (counted in `u8` scalars per chunk, the loop was unrolled into twice as many
/// counters as registers hold, and widened every [`CHUNK`] bytes).
struct Lanes {
    letters: [u8; LANES],
    blanks: [u8; LANES],
    newlines: [u8; LANES],
    digits: [u8; LANES],
    backslashes: [u8; LANES],
    any: [u8; LANES],
    low: [u8; LANES],
}

impl Lanes {
    fn new() -> Lanes {
        Lanes {
            letters: [0; LANES],
            blanks: [0; LANES],
            newlines: [0; LANES],
            digits: [0; LANES],
            backslashes: [0; LANES],
            any: [0; LANES],
            low: [u8::MAX; LANES],
        }
    }

    /// Counts one block's ASCII classes (see [`Classes::count`] for `LITERAL`).
    #[inline(always)]
    fn ascii<const LITERAL: bool>(&mut self, block: &[u8; LANES]) {
        for (i, &b) in block.iter().enumerate() {
            // `| 0x20` folds upper case onto lower case; non-ASCII bytes land above `z`.
            self.letters[i] += u8::from((b | 0x20).wrapping_sub(b'a') < 26);
            self.digits[i] += u8::from(b.wrapping_sub(b'0') < 10);
            self.any[i] |= b;
            if LITERAL {
                // The inside of a literal without escapes: tabs and line breaks are control
                // characters, which make it invalid (the lowest byte tells), and it holds no
                // backslash.
                self.blanks[i] += u8::from(b == b' ');
                self.low[i] = self.low[i].min(b);
            } else {
                self.blanks[i] += u8::from(b == b' ') | u8::from(b == b'\t');
                self.newlines[i] += u8::from(b == b'\n') | u8::from(b == b'\r');
                self.backslashes[i] += u8::from(b == b'\\');
            }
        }
    }
}

/// The non-ASCII classes of a chunk, in lanes as [`Lanes`].
struct WideLanes {
    ascii: [u8; LANES],
    non_ascii: [u8; LANES],
    cjk: [u8; LANES],
}

impl WideLanes {
    #[inline(always)]
    fn count(&mut self, block: &[u8; LANES]) {
        for (i, &b) in block.iter().enumerate() {
            self.ascii[i] += u8::from(b < 0x80);
            // A character's first byte is 0xC0 or above; continuation bytes are 0x80..0xC0.
            self.non_ascii[i] += u8::from(b >= 0xC0);
            // 0xE3..=0xEF starts U+3000..U+FFFF: CJK punctuation, kana, CJK ideographs, Yi,
            // hangul, private use and the fullwidth forms (U+FF00..).
            self.cjk[i] += u8::from(b.wrapping_sub(0xE3) < 13);
        }
    }
}

/// A lane counter's total.
fn sum(lanes: &[u8; LANES]) -> usize {
    lanes.iter().map(|&l| usize::from(l)).sum()
}

/// Whether any lane of `low` (the lowest byte each lane saw) is a control character, tested
/// as one 128-bit word: a fold over the lanes compiled to sixteen scalar comparisons.
fn any_control(low: [u8; LANES]) -> bool {
    const ONES: u128 = u128::from_le_bytes([1; LANES]);
    const HIGHS: u128 = u128::from_le_bytes([0x80; LANES]);
    let x = u128::from_le_bytes(low);
    // A lane below 0x20 borrows into its high bit; a borrow only reaches lanes above such a
    // lane, so "any" is exact.
    x.wrapping_sub(ONES * 0x20) & !x & HIGHS != 0
}

/// Whether any lane of `any` (the bytes each lane saw, or-ed) has its high bit set: whether
/// the chunk held a non-ASCII byte.
fn any_non_ascii(any: [u8; LANES]) -> bool {
    u128::from_le_bytes(any) & u128::from_le_bytes([0x80; LANES]) != 0
}

/// The last partial block of `chunk` (its last `rest` bytes, 0 < `rest` < [`LANES`]) as a
/// full one, padded with [`PAD`]. (Its last 16 bytes with those counted already replaced
/// saved the copy, but the compiler then shuffled the loop's counters between registers at
/// every block: 27 instructions a block for 22.)
#[inline(always)]
fn last_block(chunk: &[u8], rest: usize) -> [u8; LANES] {
    let mut block = [PAD; LANES];
    if let (Some(to), Some(from)) = (block.get_mut(..rest), chunk.get(chunk.len() - rest..)) {
        to.copy_from_slice(from);
    }
    block
}

/// The backslash pairs of the inside of a JSON string literal, by what an escape with that
/// second byte stands for. They are its escapes when no backslash is escaped (`other` is 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Escapes {
    /// `\n` and `\r`: a line break in the text, a letter in the raw bytes.
    newlines: usize,
    /// `\t`: a blank in the text, a letter in the raw bytes.
    blanks: usize,
    /// `\b` and `\f`: a control character (a symbol) in the text, a letter in the raw bytes.
    controls: usize,
    /// Any other pair but `\"` and `\/` (symbols either way): `\\`, `\u`, invalid ones.
    other: usize,
}

impl Escapes {
    fn add(&mut self, other: &Escapes) {
        self.newlines += other.newlines;
        self.blanks += other.blanks;
        self.controls += other.controls;
        self.other += other.other;
    }

    /// Counts the pairs of `bytes` in one pass: each byte is tested with the byte before it,
    /// so the loop vectorises as [`Classes::of`] does. Tool output holds an escape every few
    /// dozen bytes, where finding them one by one costs more than the bytes between them.
    fn of(bytes: &[u8]) -> Escapes {
        let mut total = Escapes::default();
        let seconds = bytes.get(1..).unwrap_or_default();
        for (chunk, before) in seconds.chunks(CHUNK).zip(bytes.chunks(CHUNK)) {
            total.add(&Escapes::pairs(chunk, before).0);
        }
        total
    }

    /// The pairs of one chunk (at most [`CHUNK`] bytes), `before` holding the byte before
    /// each, and how many of its bytes stop [`json_literal_weight`]'s pass: a quote not after
    /// a backslash (the closing quote, or one after an escaped backslash) or a control
    /// character.
    #[inline(always)]
    fn pairs(chunk: &[u8], before: &[u8]) -> (Escapes, u8) {
        let (mut newlines, mut blanks, mut controls, mut other) = (0u8, 0u8, 0u8, 0u8);
        let mut stops = 0u8;
        for (&b, &p) in chunk.iter().zip(before) {
            let escaped = u8::from(p == b'\\');
            let newline = u8::from(b == b'n') | u8::from(b == b'r');
            let blank = u8::from(b == b't');
            let control = u8::from(b == b'b') | u8::from(b == b'f');
            let quote = u8::from(b == b'"');
            let symbol = quote | u8::from(b == b'/');
            newlines += escaped & newline;
            blanks += escaped & blank;
            controls += escaped & control;
            other += escaped & !(newline | blank | control | symbol) & 1;
            stops += (quote & !escaped & 1) | u8::from(b < 0x20);
        }
        let escapes = Escapes {
            newlines: usize::from(newlines),
            blanks: usize::from(blanks),
            controls: usize::from(controls),
            other: usize::from(other),
        };
        (escapes, stops)
    }
}

impl Classes {
    /// Counts `bytes` (valid UTF-8) in one pass.
    ///
    /// Each byte is tested by arithmetic comparisons, not a lookup table, so the loop
    /// vectorises; counts go into byte lanes ([`Lanes`]) and are widened once per
    /// [`LANE_CHUNK`] (summing straight into `usize` would widen every lane to 64 bits and
    /// process a few bytes per step).
    fn of(bytes: &[u8]) -> Classes {
        Classes::count::<false>(bytes).0
    }

    /// The pass itself, and with `LITERAL` whether a control character (below 0x20) was seen:
    /// a JSON literal may hold none unescaped, and [`json_literal_weight`] needs no other pass
    /// to know (elsewhere the test would cost 5% for nothing). Most text an agent sends is
    /// ASCII: the ASCII classes are counted first, noting on the way whether any byte was
    /// not, and only such a chunk is read again (from the first-level cache) for the three
    /// classes of non-ASCII bytes. (Before, a whole-text `is_ascii` pass chose between two
    /// counts: a pass more over every literal, 9% of a scan of plain messages.)
    ///
    /// Counts go into [`Lanes`], widened once per [`LANE_CHUNK`] bytes (once per text for
    /// most). A text's last partial block is counted from a copy padded with [`PAD`], which
    /// no class but ASCII counts: the vector body does all the work.
    /// Left to the compiler's epilogues, the last few bytes were counted one at a time
    /// (about twenty instructions each), a fixed cost per literal that most message texts,
    /// a few hundred bytes long, paid in full.
    fn count<const LITERAL: bool>(bytes: &[u8]) -> (Classes, bool) {
        let mut total = Classes::default();
        let mut control = false;
        for chunk in bytes.chunks(LANE_CHUNK) {
            let mut lanes = Lanes::new();
            let mut blocks = chunk.chunks_exact(LANES);
            for block in blocks.by_ref() {
                if let Ok(block) = <&[u8; LANES]>::try_from(block) {
                    lanes.ascii::<LITERAL>(block);
                }
            }
            let rest = blocks.remainder().len();
            let last = (rest > 0).then(|| last_block(chunk, rest));
            if let Some(last) = &last {
                lanes.ascii::<LITERAL>(last);
            }
            if LITERAL {
                control |= any_control(lanes.low);
            }
            total.letters += sum(&lanes.letters);
            total.blanks += sum(&lanes.blanks);
            total.digits += sum(&lanes.digits);
            if !LITERAL {
                total.newlines += sum(&lanes.newlines);
                total.backslashes += sum(&lanes.backslashes);
            }
            if !any_non_ascii(lanes.any) {
                total.ascii += chunk.len();
                continue;
            }
            let mut wide = WideLanes {
                ascii: [0; LANES],
                non_ascii: [0; LANES],
                cjk: [0; LANES],
            };
            for block in chunk.chunks_exact(LANES) {
                if let Ok(block) = <&[u8; LANES]>::try_from(block) {
                    wide.count(block);
                }
            }
            if let Some(last) = &last {
                wide.count(last);
            }
            // The padding is ASCII.
            let padding = if rest > 0 { LANES - rest } else { 0 };
            total.ascii += sum(&wide.ascii) - padding;
            total.non_ascii += sum(&wide.non_ascii);
            total.cjk += sum(&wide.cjk);
        }
        (total, control)
    }

    /// The counts of a literal's text from those of its raw bytes and its escapes, when every
    /// backslash starts one of them.
    fn unescaped(mut self, escapes: &Escapes) -> Classes {
        self.ascii -= self.backslashes;
        self.letters -= escapes.newlines + escapes.blanks + escapes.controls;
        self.newlines += escapes.newlines;
        self.blanks += escapes.blanks;
        self
    }

    fn add(&mut self, other: &Classes) {
        self.letters += other.letters;
        self.blanks += other.blanks;
        self.newlines += other.newlines;
        self.digits += other.digits;
        self.ascii += other.ascii;
        self.non_ascii += other.non_ascii;
        self.cjk += other.cjk;
        self.backslashes += other.backslashes;
    }

    /// The weighted sum of the classes.
    fn weight(&self) -> usize {
        let symbols = self.ascii - self.letters - self.blanks - self.newlines - self.digits;
        self.letters * LETTER_WEIGHT
            + self.blanks * BLANK_WEIGHT
            + self.newlines * NEWLINE_WEIGHT
            + self.digits * DIGIT_WEIGHT
            + symbols * SYMBOL_WEIGHT
            + self.cjk * CJK_WEIGHT
            + (self.non_ascii - self.cjk) * OTHER_WEIGHT
    }
}

/// The weight of a text: the sum of its characters' class weights, in [`WEIGHT_PER_TOKEN`]ths
/// of a token at the default rate.
pub fn text_weight(s: &str) -> usize {
    Classes::of(s.as_bytes()).weight()
}

/// The weight of a JSON string literal's text: `raw` is the literal as sent, quotes and
/// escapes included, and the result equals [`text_weight`] of the decoded string. It is
/// computed on the escaped bytes in place, sparing the copy decoding makes: each escape
/// stands for one character of a known class (`\n` a line break, `\t` a blank, `\"` a
/// symbol...), so the counts of the raw bytes are corrected per escape. `None` for a literal
/// with a `\u` escape (decode it instead) or for text that is not a string literal.
pub fn json_string_weight(raw: &str) -> Option<usize> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?.as_bytes();
    let mut classes = Classes::of(inner);
    if classes.backslashes == 0 {
        return Some(classes.weight());
    }
    let escapes = Escapes::of(inner);
    if escapes.other == 0 && inner.last() != Some(&b'\\') {
        // No backslash is escaped, so each one starts an escape counted by its second byte.
        return Some(classes.unescaped(&escapes).weight());
    }
    // An escaped backslash (after which a backslash no longer always starts an escape), a
    // `\u`, an invalid escape or a backslash escaping the closing quote: escape by escape.
    let mut at = 0;
    while let Some(found) = memchr::memchr(b'\\', inner.get(at..)?) {
        let escape = at + found;
        let escaped = *inner.get(escape + 1)?;
        // The backslash is not part of the text.
        classes.ascii -= 1;
        match escaped {
            // A letter in the raw bytes, a line break or a blank in the text.
            b'n' | b'r' => {
                classes.letters -= 1;
                classes.newlines += 1;
            }
            b't' => {
                classes.letters -= 1;
                classes.blanks += 1;
            }
            // A letter in the raw bytes, a control character (a symbol) in the text.
            b'b' | b'f' => classes.letters -= 1,
            // A symbol either way.
            b'"' | b'\\' | b'/' => {}
            _ => return None,
        }
        at = escape + 2;
    }
    Some(classes.weight())
}

/// The length and weight of the JSON string literal at the start of `text` (its opening
/// quote), found in one pass: the pass that counts the classes and the escapes also looks for
/// the closing quote, so a caller reading a body by hand need not find the literal's end first
/// (a second pass over the bytes, stopping at every escape). The weight is
/// [`json_string_weight`]'s.
///
/// `None` for anything but a literal whose escapes are all of one character (`\n`, `\"`,
/// ...) and which holds no control character: a `\u` escape, an invalid escape, a raw control
/// character (invalid JSON), no closing quote. The caller reads those the slow way, which
/// either decodes them or says what is wrong.
pub fn json_literal_weight(text: &[u8]) -> Option<(usize, usize)> {
    if text.first() != Some(&b'"') {
        return None;
    }
    let inside = text.get(1..)?;
    // A literal without escapes (most, and most plain text): its closing quote is the first
    // quote or backslash, looked for with SIMD (`memchr2`: a long literal's search was a
    // tenth of a scan as a word-at-a-time loop).
    let first = memchr::memchr2(b'"', b'\\', inside)?;
    if inside.get(first) == Some(&b'"') {
        let (classes, control) = Classes::count::<true>(inside.get(..first)?);
        if control {
            return None;
        }
        return Some((first + 2, classes.weight()));
    }
    let mut classes = Classes::default();
    let mut escapes = Escapes::default();
    // Chunks of the inside whose pairs (each byte with the one before it) are all plain: no
    // closing quote, no control character, no escape of more than one byte, no escaped
    // backslash (after which a backslash would not start an escape).
    let mut start = 1;
    while let (Some(chunk), Some(before)) = (
        text.get(start..start + CHUNK),
        text.get(start - 1..start - 1 + CHUNK),
    ) {
        // Most chunks of most text hold no quote, backslash or control character: then the
        // classes are all there is to count.
        let special = chunk.iter().fold(0u8, |any, &b| {
            any | u8::from(b == b'"') | u8::from(b == b'\\') | u8::from(b < 0x20)
        });
        // (A backslash just before the chunk escapes its first byte, whatever that is.)
        if special != 0 || before.first() == Some(&b'\\') {
            let (e, stops) = Escapes::pairs(chunk, before);
            if stops > 0 || e.other > 0 {
                break;
            }
            escapes.add(&e);
        }
        classes.add(&Classes::count::<false>(chunk).0);
        start += CHUNK;
    }
    // The rest, escape by escape up to the closing quote. A backslash before `start` starts
    // an escape: no backslash before it is escaped.
    let mut escaped = text.get(start - 1) == Some(&b'\\') && start > 1;
    let mut end = start;
    let mut simple = true;
    let mut any_escape = escaped;
    loop {
        if std::mem::take(&mut escaped) {
            match *text.get(end)? {
                b'"' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                b'\\' => simple = false,
                _ => return None,
            }
            end += 1;
        }
        end += quote_or_backslash(text.get(end..)?)?;
        if text.get(end) == Some(&b'"') {
            break;
        }
        escaped = true;
        any_escape = true;
        end += 1;
    }
    let len = end + 1;
    // Control characters are not JSON (the chunks above had none).
    if text
        .get(start..end)?
        .iter()
        .fold(0xff, |min: u8, &b| min.min(b))
        < 0x20
    {
        return None;
    }
    if !simple {
        // An escaped backslash: escape by escape.
        return json_string_weight(std::str::from_utf8(text.get(..len)?).ok()?).map(|w| (len, w));
    }
    let rest = text.get(start..end)?;
    classes.add(&Classes::of(rest));
    if any_escape {
        // From the byte before `start`: the pair it makes with the first byte of the rest may
        // be an escape (with the opening quote it is none).
        escapes.add(&Escapes::of(text.get(start - 1..end)?));
    }
    Some((len, classes.unescaped(&escapes).weight()))
}

/// The index of the first `"` or `\\` in `b`.
///
/// Tool output is dense with escapes (a `\n` or `\"` every few dozen bytes), so the search is
/// a word at a time rather than a vector search with its set-up cost per call.
pub(crate) fn quote_or_backslash(b: &[u8]) -> Option<usize> {
    first_special::<false>(b)
}

/// The index of the first `"`, `\\` or control character in `b`: where a string literal's
/// inside that holds neither escapes nor anything invalid ends, if it ends at a quote. One
/// pass where [`quote_or_backslash`] and a look for control characters before the quote were
/// two (keys, roles and ids are read this way, three or more a message).
pub(crate) fn quote_backslash_or_control(b: &[u8]) -> Option<usize> {
    first_special::<true>(b)
}

/// [`quote_or_backslash`], and with `CONTROL` control characters (below 0x20) too, a word at
/// a time.
#[inline(always)]
fn first_special<const CONTROL: bool>(b: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const SPACES: u64 = u64::from_ne_bytes([0x20; 8]);
    const QUOTES: u64 = u64::from_ne_bytes([b'"'; 8]);
    const BACKSLASHES: u64 = u64::from_ne_bytes([b'\\'; 8]);
    let mut chunks = b.chunks_exact(8);
    let mut i = 0;
    for chunk in chunks.by_ref() {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let word = u64::from_le_bytes(bytes);
        let (q, s) = (word ^ QUOTES, word ^ BACKSLASHES);
        // The lowest byte that is zero in `q` or `s` (or, with `CONTROL`, below 0x20 in
        // `word`) sets its high bit here (bytes above it may be false positives; only the
        // lowest is used).
        let mut hits = q.wrapping_sub(ONES) & !q | s.wrapping_sub(ONES) & !s;
        if CONTROL {
            hits |= word.wrapping_sub(SPACES) & !word;
        }
        let hits = hits & HIGHS;
        if hits != 0 {
            return Some(i + (hits.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&c| matches!(c, b'"' | b'\\') || (CONTROL && c < 0x20))
        .map(|at| i + at)
}

/// The weight of JSON text as the model reads it. JSON is mostly read as sent, escapes and all
/// (`\n`, `\"` are what a model writes in tool arguments), except `\uXXXX` escapes of non-ASCII
/// characters, which clients that escape everything (Python's `json.dumps` by default) send
/// but the provider decodes: such text is weighed as it is written back without them.
pub fn json_weight(raw: &str) -> usize {
    if raw.contains("\\u") {
        if let Ok(text) = serde_json::from_str::<serde_json::Value>(raw)
            .and_then(|value| serde_json::to_string(&value))
        {
            return text_weight(&text);
        }
    }
    text_weight(raw)
}

/// Unicode scalar values in `s`, for cutting text to a length (the estimate weighs text with
/// [`text_weight`]), counted as the bytes that do not continue a UTF-8 sequence (branch-free,
/// so it vectorises; much cheaper than decoding).
pub fn count_chars(s: &str) -> usize {
    let bytes = s.as_bytes();
    // Most text an agent sends is ASCII: one word-at-a-time check and the length is the answer.
    if bytes.is_ascii() {
        return bytes.len();
    }
    // Counted in byte lanes per chunk, as in `Classes::of`.
    let continuation: usize = bytes
        .chunks(CHUNK)
        .map(|chunk| {
            let n: u8 = chunk
                .iter()
                .map(|&b| u8::from((b as i8) < -0x40))
                .fold(0, |acc, x| acc.wrapping_add(x));
            usize::from(n)
        })
        .sum();
    bytes.len() - continuation
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_class_has_its_weight() {
        assert_eq!(text_weight(""), 0);
        assert_eq!(text_weight("abcXYZ"), 6 * LETTER_WEIGHT);
        assert_eq!(text_weight(" \t"), 2 * BLANK_WEIGHT);
        assert_eq!(text_weight("\r\n"), 2 * NEWLINE_WEIGHT);
        assert_eq!(text_weight("0189"), 4 * DIGIT_WEIGHT);
        assert_eq!(text_weight("{}\\\"@[`~\u{0}\u{7f}"), 10 * SYMBOL_WEIGHT);
        // Chinese, hiragana, katakana, hangul, CJK and fullwidth punctuation.
        assert_eq!(text_weight("日本かカ한。，"), 7 * CJK_WEIGHT);
        // Latin-1, Cyrillic, Greek, a general punctuation quote, Thai, an emoji.
        assert_eq!(text_weight("éжλ“ก🦀"), 6 * OTHER_WEIGHT);
        // Bytes around each range's edges are not miscounted.
        assert_eq!(text_weight("/:@[`{"), 6 * SYMBOL_WEIGHT);
        assert_eq!(
            text_weight("\u{2fff}\u{3000}\u{ffff}\u{10000}"),
            2 * OTHER_WEIGHT + 2 * CJK_WEIGHT
        );
    }

    #[test]
    fn the_count_crosses_chunks_at_every_offset() {
        // Both chunk sizes: the escapes' and the class count's lanes'.
        for prefix in (0..2 * CHUNK).chain(LANE_CHUNK - 2 * LANES..LANE_CHUNK + 2 * LANES) {
            let s = format!("{}{}", "a".repeat(prefix), "é日🦀x 1,\n".repeat(50));
            let expected = prefix * LETTER_WEIGHT
                + 50 * (2 * OTHER_WEIGHT
                    + CJK_WEIGHT
                    + LETTER_WEIGHT
                    + BLANK_WEIGHT
                    + DIGIT_WEIGHT
                    + SYMBOL_WEIGHT
                    + NEWLINE_WEIGHT);
            assert_eq!(text_weight(&s), expected, "prefix {prefix}");
            assert_eq!(count_chars(&s), s.chars().count(), "prefix {prefix}");
            // The same without its non-ASCII characters takes the ASCII-only pass.
            let ascii: String = s.chars().filter(char::is_ascii).collect();
            let non_ascii = 50 * (2 * OTHER_WEIGHT + CJK_WEIGHT);
            assert_eq!(text_weight(&ascii), expected - non_ascii, "prefix {prefix}");
            // A literal without escapes (the padded last chunk of every length), and the same
            // with a raw control character as its last byte, which makes it invalid.
            let plain = format!("{}{}", "a".repeat(prefix), "x 1,".repeat(50));
            let weight = prefix * LETTER_WEIGHT
                + 50 * (LETTER_WEIGHT + BLANK_WEIGHT + DIGIT_WEIGHT + SYMBOL_WEIGHT);
            let literal = format!("\"{plain}\"");
            assert_eq!(
                json_literal_weight(literal.as_bytes()),
                Some((literal.len(), weight)),
                "prefix {prefix}"
            );
            let control = format!("\"{plain}\u{1f}\"");
            assert_eq!(json_literal_weight(control.as_bytes()), None, "{prefix}");
        }
    }

    #[test]
    fn weights_become_tokens_rounded_up() {
        assert_eq!(TOKENS_PER_CHAR, 0.25);
        let e = LazyEstimator::default();
        assert_eq!(e.weight(0), 0);
        assert_eq!(e.weight(100), 1);
        assert_eq!(e.weight(101), 2, "rounded up");
        assert_eq!(e.text(&"x".repeat(5000)), 1000, "five letters per token");
        assert_eq!(
            e.text("日本語日"),
            3,
            "four CJK characters are about three tokens"
        );
    }

    #[test]
    fn the_default_rate_rounds_in_integers_as_the_float_path_does() {
        let default = LazyEstimator::default();
        // The float path of every other rate, at the default one.
        let float = |w: usize| (w as f64 / WEIGHT_PER_TOKEN as f64).ceil() as usize;
        let large = (0..52).map(|shift| (1usize << 52) >> shift);
        for w in (0..100_000).chain(large.flat_map(|w| [w - 1, w, w + 1])) {
            assert_eq!(default.weight(w), float(w), "{w}");
        }
        assert_eq!(
            LazyEstimator::new(0.25),
            default,
            "0.25 is the default rate"
        );
    }

    #[test]
    fn the_first_quote_backslash_or_control_is_found_at_any_offset() {
        for len in 0..40 {
            for at in 0..len {
                for c in [b'"', b'\\', 0x00, b'\n', 0x1f] {
                    // Everything before `at` is plain (letters, symbols just above the
                    // control characters, non-ASCII bytes); a stop after it never counts.
                    let mut b: Vec<u8> =
                        (0..len).map(|i| [b'a', b' ', b'!', 0xe9][i % 4]).collect();
                    b[at] = c;
                    if at + 1 < len {
                        b[at + 1] = b'"';
                    }
                    assert_eq!(quote_backslash_or_control(&b), Some(at), "{len} {at} {c}");
                }
            }
            assert_eq!(quote_backslash_or_control(&vec![0x7f; len]), None);
            assert_eq!(quote_backslash_or_control(&vec![0xe9; len]), None);
        }
    }

    #[test]
    fn image_cost_is_fixed_and_documented() {
        assert_eq!(IMAGE_TOKENS, 765);
        let e = LazyEstimator::default();
        assert_eq!(
            e.counts(Counts {
                text: 8 * LETTER_WEIGHT,
                images: 2
            }),
            2 + 2 * 765
        );
    }

    #[test]
    fn characters_not_bytes_are_counted() {
        assert_eq!(count_chars("héllo"), 5);
        assert_eq!(count_chars("日本語"), 3);
        assert_eq!(count_chars("🦀🦀"), 2);
        assert_eq!(count_chars(""), 0);
    }

    proptest::proptest! {
        /// Literals dense with escapes of every kind, long enough to cross chunks: the counts
        /// by backslash pairs, the escape-by-escape walk (escaped backslashes, `\/`) and the
        /// decoded text agree.
        #[test]
        fn escaped_literals_weigh_as_their_decoded_text(
            text in "[a\\\\\"/\n\r\t\u{8}\u{c} 1é日]{0,600}",
            slashes in proptest::bool::ANY,
        ) {
            let mut raw = serde_json::to_string(&text).expect("literal");
            if slashes {
                raw = raw.replace('/', "\\/");
            }
            proptest::prop_assert_eq!(json_string_weight(&raw), Some(text_weight(&text)));
            let body = format!("{raw},\"k\":\"\\\"\"}}");
            proptest::prop_assert_eq!(
                json_literal_weight(body.as_bytes()),
                Some((raw.len(), text_weight(&text)))
            );
            // The pair counts are exact only without escaped backslashes.
            let inner = &raw.as_bytes()[1..raw.len() - 1];
            let walked = Escapes::of(inner);
            if !text.contains('\\') {
                let escaped = |c: char| text.matches(c).count();
                proptest::prop_assert_eq!(walked.newlines, escaped('\n') + escaped('\r'));
                proptest::prop_assert_eq!(walked.blanks, escaped('\t'));
                proptest::prop_assert_eq!(walked.controls, escaped('\u{8}') + escaped('\u{c}'));
                proptest::prop_assert_eq!(walked.other, 0);
            }
        }
    }

    #[test]
    fn literals_are_found_and_weighed_in_one_pass() {
        let heavy = "let s = \"a\\tb\";\n\té 日 /x/ \u{8}".repeat(40);
        let late = format!("{}\\\"end", "\"q\"\n".repeat(100));
        for text in [
            "",
            "plain words",
            "quotes \" and \\ backslashes \\\" and / slashes",
            "ends with a backslash \\",
            "\\",
            heavy.as_str(),
            late.as_str(),
            &"x".repeat(500),
        ] {
            let raw = serde_json::to_string(text).expect("literal");
            for after in ["", "}", ",\"k\":\"v\"}]", "  \"next\\\" \\"] {
                let body = format!("{raw}{after}");
                assert_eq!(
                    json_literal_weight(body.as_bytes()),
                    Some((raw.len(), text_weight(text))),
                    "{body}"
                );
            }
        }
        // An escape at every offset around the end of the first chunks, the chunks after it
        // free of anything special.
        for at in CHUNK - 4..CHUNK + 4 {
            for escape in ["\\n", "\\t", "\\\"", "\\f"] {
                let raw = format!(
                    "\"{}{escape}{}\"",
                    "a".repeat(at - 1),
                    "b".repeat(2 * CHUNK)
                );
                let text: String = serde_json::from_str(&raw).expect("literal");
                let weight = json_literal_weight(raw.as_bytes());
                assert_eq!(weight, Some((raw.len(), text_weight(&text))), "{at}");
                let unicode = raw.replace(escape, "\\u0041");
                assert_eq!(json_literal_weight(unicode.as_bytes()), None, "{at}");
            }
        }
        for bad in [
            "x",
            "\"open",
            "\"open \\\"",
            "\"\\u00e9\"",
            "\"\\x\"",
            "\"raw \u{1} control\"",
            // A raw control character in a later chunk of a literal without escapes.
            &format!("\"{}\u{1}{}\"", "a".repeat(CHUNK + 7), "é".repeat(CHUNK)),
            &format!("\"{}\\u0041\"", "\\n".repeat(200)),
            &format!("\"{}\u{1f}\"", "\\n".repeat(200)),
        ] {
            assert_eq!(json_literal_weight(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn string_literals_weigh_as_their_decoded_text() {
        for text in [
            "",
            "plain words",
            "line one\nline two\r\n\ttabbed",
            "quotes \" and \\ backslashes \\\" and / slashes",
            "\\n is not a line break here",
            "ends with a backslash \\",
            "control \u{8} \u{c} characters",
            "naïve 中文 ✓ \n mixed",
        ] {
            let raw = serde_json::to_string(text).expect("literal");
            assert_eq!(json_string_weight(&raw), Some(text_weight(text)), "{raw}");
            // A literal escaping `/` (allowed, never produced by serde_json).
            let slashed = raw.replace('/', "\\/");
            assert_eq!(
                json_string_weight(&slashed),
                Some(text_weight(text)),
                "{slashed}"
            );
        }
        assert_eq!(
            json_string_weight(r#""\u00e9t\u00e9""#),
            None,
            "\\u: decode instead"
        );
        assert_eq!(json_string_weight("[1]"), None);
        assert_eq!(json_string_weight(r#""dangling \""#), None);
        assert_eq!(json_string_weight(r#""dangling \\\""#), None);
        assert_eq!(json_string_weight(r#""\x""#), None, "not an escape");
        assert_eq!(
            json_string_weight(r#""a\"\u0041""#),
            None,
            "\\u after others"
        );
    }

    #[test]
    fn json_is_weighed_as_the_model_reads_it() {
        // Escapes of quotes and line breaks are read as written.
        let raw = r#"{"command":"echo \"hi\"\n"}"#;
        assert_eq!(json_weight(raw), text_weight(raw));
        // `\u` escapes of non-ASCII text are read decoded.
        assert_eq!(
            json_weight(r#"{"q":"\u65e5\u672c"}"#),
            text_weight(r#"{"q":"日本"}"#)
        );
        // Text that is not JSON is weighed as it is.
        assert_eq!(json_weight(r"\u65e5"), text_weight(r"\u65e5"));
    }

    #[test]
    fn the_rate_scales_every_weight_and_bad_rates_fall_back() {
        assert_eq!(LazyEstimator::new(f64::NAN), LazyEstimator::default());
        assert_eq!(LazyEstimator::new(-1.0), LazyEstimator::default());
        assert_eq!(
            LazyEstimator::new(TOKENS_PER_CHAR),
            LazyEstimator::default()
        );
        let e = LazyEstimator::new(0.5);
        assert_eq!(e.weight(300), 6, "twice the default rate");
        assert_eq!(e.weight_for_tokens(6), 300);
        assert_eq!(LazyEstimator::default().weight_for_tokens(10), 1000);
    }
}
