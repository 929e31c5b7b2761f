//! Model → context window (and price) lookup over the `[models]` table.
//!
//! Keys are exact model names or globs where `*` matches any run of characters. An exact
//! name wins; otherwise the longest matching glob wins (ties: the lexicographically first
//! pattern, so the answer never depends on load order). Matching ignores ASCII case. A name
//! routed through an aggregator (`openai/gpt-4o`, `anthropic/claude-sonnet-4`) that matches
//! nothing is retried with the part after its last `/`. Anything unmatched gets
//! `compaction.default_context_window`.
//!
//! The table is what the operator wrote; providers sometimes know better. A window a provider
//! names when it refuses a request for its length, or one its `usage` shows to be too small, is
//! a [`LearnedWindow`]: the session store keeps those per model ([`model_key`]), and the
//! pipeline prefers them to the table.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::config::{Config, ModelConfig, Price};

/// What the table says of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    /// Its context window in tokens.
    pub window: usize,
    /// Its prices, when the entry names them.
    pub price: Option<Price>,
}

/// The compiled models table.
#[derive(Debug, Clone)]
pub struct ModelTable {
    exact: HashMap<String, Entry, foldhash::fast::RandomState>,
    /// Lowercased patterns containing `*`, longest first.
    globs: Vec<(Glob, Entry)>,
    default_window: usize,
}

impl ModelTable {
    /// Builds the table from the config's `[models]` entries.
    /// The table of `config`. An entry the operator added for one model without naming a
    /// price (to set its window, say) keeps the price the shipped table gives that model:
    /// saying nothing about the price is not saying it has none.
    pub fn of(config: &Config) -> ModelTable {
        let default_window = config.compaction.default_context_window;
        let shipped_models = Config::shipped_models();
        let shipped = ModelTable::new(&shipped_models, default_window);
        let mut models = config.models.clone();
        for (name, model) in &mut models {
            if model.price.is_none() && !name.contains('*') && !shipped_models.contains_key(name) {
                model.price = shipped.price(name);
            }
        }
        ModelTable::new(&models, default_window)
    }

    /// The table of `models`, as written.
    pub fn new(models: &BTreeMap<String, ModelConfig>, default_window: usize) -> ModelTable {
        let mut exact = HashMap::default();
        let mut globs = Vec::new();
        for (name, model) in models {
            let key = name.to_ascii_lowercase();
            let entry = Entry {
                window: model.context_window,
                price: model.price,
            };
            if key.contains('*') {
                globs.push((key, entry));
            } else {
                exact.insert(key, entry);
            }
        }
        // Longest first; equal lengths in lexicographic order (stable and deterministic).
        globs.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        ModelTable {
            exact,
            globs: globs
                .into_iter()
                .map(|(pattern, entry)| (Glob::new(&pattern), entry))
                .collect(),
            default_window,
        }
    }

    /// The context window of `model`, or the default when it is unknown or absent.
    pub fn context_window(&self, model: Option<&str>) -> usize {
        model
            .and_then(|m| self.lookup(m))
            .unwrap_or(self.default_window)
    }

    /// The prices of `model`, when its entry names them (the entry that gives its window: a
    /// less specific one's prices are not borrowed, as its variants may cost differently).
    pub fn price(&self, model: &str) -> Option<Price> {
        self.entry(model).and_then(|e| e.price)
    }

    /// The table's window for `model`, if it has an entry.
    pub fn lookup(&self, model: &str) -> Option<usize> {
        self.entry(model).map(|e| e.window)
    }

    /// The table entry for `model`, if any.
    pub fn entry(&self, model: &str) -> Option<Entry> {
        let name = model.trim();
        // Model names are sent lowercase: no copy then.
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            std::borrow::Cow::Owned(name.to_ascii_lowercase())
        } else {
            std::borrow::Cow::Borrowed(name)
        };
        self.lookup_lower(&name).or_else(|| {
            let (_, short) = name.rsplit_once('/')?;
            self.lookup_lower(short)
        })
    }

    fn lookup_lower(&self, name: &str) -> Option<Entry> {
        if name.is_empty() {
            return None;
        }
        if let Some(e) = self.exact.get(name) {
            return Some(*e);
        }
        self.globs
            .iter()
            .find(|(glob, _)| glob.matches(name))
            .map(|(_, e)| *e)
    }
}

/// What a model's name is given, for its window, when a request enables Anthropic's
/// 1M-token context (an `anthropic-beta` flag `context-1m-…`): the same model has two windows,
/// chosen per request, so its window is looked up and learned under `<model>[1m]` (Claude
/// Code's own name for it, `sonnet[1m]`). The models table lists those names.
pub const LONG_CONTEXT_SUFFIX: &str = "[1m]";

/// Whether an `anthropic-beta` header value enables the 1M-token context window.
pub fn enables_long_context(anthropic_beta: &str) -> bool {
    anthropic_beta
        .split(',')
        .any(|flag| flag.trim().starts_with("context-1m"))
}

/// The name a request's window is looked up and learned under: the model's own, or with
/// [`LONG_CONTEXT_SUFFIX`] when the request enables the long context.
pub fn window_model(model: &str, long_context: bool) -> std::borrow::Cow<'_, str> {
    if long_context {
        std::borrow::Cow::Owned(format!("{model}{LONG_CONTEXT_SUFFIX}"))
    } else {
        std::borrow::Cow::Borrowed(model)
    }
}

/// Longest model name kept as a key of a learned window (longer names are cut at a character
/// boundary: model names come from clients).
pub const MAX_MODEL_KEY_LEN: usize = 128;

/// The key a model's learned window is kept under: trimmed, ASCII-lowercased, at most
/// [`MAX_MODEL_KEY_LEN`] bytes.
pub fn model_key(model: &str) -> String {
    let mut key = model.trim().to_ascii_lowercase();
    if key.len() > MAX_MODEL_KEY_LEN {
        let mut cut = MAX_MODEL_KEY_LEN;
        while !key.is_char_boundary(cut) {
            cut -= 1;
        }
        key.truncate(cut);
    }
    key
}

/// The key a learned window is kept under: the upstream it was learned from and the model's
/// [`model_key`]. A window belongs to one provider's deployment of a model, not to its name:
/// a local server's build of a model can have a smaller window than the hosted model of the
/// same name, and what one teaches must not make the other compact late (and be refused) or
/// early. Stored as `"<upstream> <model>"`: a base URL holds no space.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WindowKey(String);

impl WindowKey {
    /// The key of `model` on `upstream` (its base URL); `None` when the model is blank.
    pub fn new(upstream: &str, model: &str) -> Option<WindowKey> {
        let model = model_key(model);
        if model.is_empty() {
            return None;
        }
        let upstream = upstream.trim().trim_end_matches('/');
        Some(WindowKey(format!("{upstream} {model}")))
    }

    /// A key as stored (a Redis hash field); `None` for one without an upstream or a model
    /// (written before windows were kept per upstream: it would never be looked up).
    pub fn from_stored(stored: String) -> Option<WindowKey> {
        let (upstream, model) = stored.split_once(' ')?;
        (!upstream.is_empty() && !model.is_empty()).then_some(WindowKey(stored))
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The upstream's base URL.
    pub fn upstream(&self) -> &str {
        self.0.split_once(' ').map_or("", |(u, _)| u)
    }

    /// The model's key.
    pub fn model(&self) -> &str {
        self.0.split_once(' ').map_or(&self.0, |(_, m)| m)
    }
}

/// How compactor learned a model's context window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowSource {
    /// The provider named it when it refused a request for its length.
    Error,
    /// The provider's `usage` counted more tokens (input plus output) in one successful
    /// request than the window compactor assumed, so the window is at least that.
    Usage,
    /// The provider refused a request for its length without naming its window (OpenAI's
    /// Responses API): the window is at most what that request asked for (its estimated input
    /// plus the output it reserved).
    Refused,
}

impl WindowSource {
    /// Every source (the metrics pre-initialise their label values).
    pub const ALL: [WindowSource; 3] = [
        WindowSource::Error,
        WindowSource::Usage,
        WindowSource::Refused,
    ];

    /// The `source` label value.
    pub fn label(self) -> &'static str {
        match self {
            WindowSource::Error => "error",
            WindowSource::Usage => "usage",
            WindowSource::Refused => "refused",
        }
    }
}

/// A model's context window as a provider showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LearnedWindow {
    /// The window, in the provider's tokens.
    pub context_window: usize,
    /// How it was learned.
    pub source: WindowSource,
    /// When (seconds since the Unix epoch).
    pub learned_unix: u64,
}

impl LearnedWindow {
    /// What is known after learning `self` where `known` was known before; `None` when
    /// nothing changes.
    ///
    /// A window named in a refusal is the provider's own statement and replaces what was known.
    /// A window seen in `usage` is only a floor (the request fitted, so the window is at least
    /// that big): it raises what is known, never lowers it. A refused request's size is only a
    /// ceiling: it lowers what is known, never raises it.
    pub fn merged_into(self, known: Option<LearnedWindow>) -> Option<LearnedWindow> {
        let Some(known) = known else {
            return (self.context_window > 0).then_some(self);
        };
        let changes = match self.source {
            WindowSource::Error => {
                self.context_window != known.context_window || known.source != WindowSource::Error
            }
            WindowSource::Usage => self.context_window > known.context_window,
            WindowSource::Refused => self.context_window < known.context_window,
        };
        (changes && self.context_window > 0).then_some(self)
    }
}

/// A model-name pattern where `*` matches any run of characters (including none) and
/// everything else matches itself, ignoring ASCII case. It is tried on every chat request
/// until one matches, so where its stars are is found once, here, and a match compares the
/// literal ends first (most patterns fail on their first byte) and then finds each literal
/// between stars at its leftmost place.
#[derive(Debug, Clone)]
pub struct Glob {
    pattern: Box<[u8]>,
    /// The first and last `*` (equal with one star); `None` without any.
    stars: Option<(usize, usize)>,
}

impl Glob {
    /// Compiles `pattern`.
    pub fn new(pattern: &str) -> Glob {
        let p = pattern.as_bytes();
        let first = p.iter().position(|&b| b == b'*');
        let last = p.iter().rposition(|&b| b == b'*');
        Glob {
            pattern: p.into(),
            stars: first.zip(last),
        }
    }

    /// Whether `text` matches.
    pub fn matches(&self, text: &str) -> bool {
        let (p, t) = (&*self.pattern, text.as_bytes());
        let Some((first, last)) = self.stars else {
            return p.eq_ignore_ascii_case(t);
        };
        let (head, tail) = (&p[..first], &p[last + 1..]);
        if t.len() < head.len() + tail.len()
            || !t[..head.len()].eq_ignore_ascii_case(head)
            || !t[t.len() - tail.len()..].eq_ignore_ascii_case(tail)
        {
            return false;
        }
        // Taking the earliest place for a literal never leaves less room for the next.
        let mut rest = &t[head.len()..t.len() - tail.len()];
        for literal in p[first + 1..last.max(first + 1)]
            .split(|&b| b == b'*')
            .filter(|s| !s.is_empty())
        {
            match rest
                .windows(literal.len())
                .position(|w| w.eq_ignore_ascii_case(literal))
            {
                Some(at) => rest = &rest[at + literal.len()..],
                None => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Wildcard matching by its definition, for comparison.
    fn matches_by_definition(p: &[u8], t: &[u8]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some((b'*', rest)) => (0..=t.len()).any(|i| matches_by_definition(rest, &t[i..])),
            Some((c, rest)) => t
                .split_first()
                .is_some_and(|(d, t)| c.eq_ignore_ascii_case(d) && matches_by_definition(rest, t)),
        }
    }

    proptest! {
        #[test]
        fn a_glob_matches_as_wildcards_are_defined(pattern in "[abA*]{0,8}", text in "[abB]{0,10}") {
            prop_assert_eq!(
                Glob::new(&pattern).matches(&text),
                matches_by_definition(pattern.as_bytes(), text.as_bytes())
            );
        }
    }

    fn table(entries: &[(&str, usize)]) -> ModelTable {
        let models = entries
            .iter()
            .map(|(k, w)| {
                (
                    k.to_string(),
                    ModelConfig {
                        context_window: *w,
                        price: None,
                    },
                )
            })
            .collect();
        ModelTable::new(&models, 1000)
    }

    #[test]
    fn the_long_context_flag_selects_the_1m_window_of_shipped_claude_models() {
        assert!(enables_long_context("context-1m-2025-08-07"));
        assert!(enables_long_context(
            "interleaved-thinking-2025-05-14, context-1m-2025-08-07"
        ));
        assert!(!enables_long_context("interleaved-thinking-2025-05-14"));
        assert!(!enables_long_context(""));
        assert_eq!(window_model("m", false), "m");
        assert_eq!(window_model("m", true), "m[1m]");
        let c = crate::config::Config::from_toml("").unwrap_or_else(|e| panic!("{e}"));
        let shipped = ModelTable::new(&c.models, c.compaction.default_context_window);
        for model in [
            "claude-sonnet-4-5-20250929",
            "claude-opus-4-1",
            "claude-haiku-4-5",
        ] {
            let window = |long| shipped.context_window(Some(&window_model(model, long)));
            assert_eq!(window(false), 200_000, "{model}");
            assert_eq!(window(true), 1_000_000, "{model}[1m]");
        }
    }

    #[test]
    fn prices_come_from_the_entry_that_gives_the_window_never_a_less_specific_one() {
        let c = crate::config::Config::from_toml("").unwrap_or_else(|e| panic!("{e}"));
        let shipped = ModelTable::new(&c.models, c.compaction.default_context_window);
        let input = |model: &str| shipped.price(model).map(|p| p.input);
        // Variants of one glob priced apart: the longer pattern or the exact name wins.
        assert_eq!(input("gpt-4o"), Some(2.5));
        assert_eq!(input("gpt-4o-mini-2024-07-18"), Some(0.15));
        assert_eq!(input("gpt-5-codex"), Some(1.25));
        assert_eq!(input("GPT-5-MINI"), Some(0.25));
        assert_eq!(input("claude-opus-4-1-20250805"), Some(15.0));
        assert_eq!(input("claude-opus-4-5-20251101"), Some(5.0));
        assert_eq!(input("openrouter/anthropic/claude-sonnet-4-5"), Some(3.0));
        // A glob whose variants cost differently names no price, and its entry's window does
        // not borrow one: no figure rather than a wrong one.
        for unpriced in [
            "gpt-5.2",
            "gpt-4o-audio-preview",
            "o3-pro",
            "claude-sonnet-4-5[1m]",
            "gemini-2.5-pro",
            "llama-3.1-70b",
            "unknown-model",
        ] {
            assert_eq!(shipped.price(unpriced), None, "{unpriced}");
        }
        assert_eq!(shipped.context_window(Some("gpt-5.2")), 272_000);
        // Anthropic writes the cache at a premium; OpenAI does not charge for writes.
        let sonnet = shipped.price("claude-sonnet-4-5").expect("priced");
        assert_eq!((sonnet.cache_read(), sonnet.cache_write()), (0.3, 3.75));
        let gpt = shipped.price("gpt-5").expect("priced");
        assert_eq!(gpt.cache_write(), gpt.input);
        // A user entry overrides a shipped price and adds one.
        let c = crate::config::Config::from_toml(
            "[models.\"gpt-5\".price]\ninput = 9.0\noutput = 90.0\n\
             [models.\"my-model\"]\ncontext_window = 8000\nprice = { input = 1.0, output = 2.0 }\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let table = ModelTable::new(&c.models, c.compaction.default_context_window);
        let over = table.price("gpt-5").expect("priced");
        assert_eq!(
            (over.input, over.output, over.cache_read()),
            (9.0, 90.0, 0.125),
            "the keys named override, the others stay as shipped"
        );
        assert_eq!(
            table.context_window(Some("gpt-5")),
            272_000,
            "the window stays"
        );
        assert_eq!(table.price("my-model").map(|p| p.output), Some(2.0));
    }

    #[test]
    fn an_entry_setting_a_shipped_models_window_keeps_its_price() {
        let c = crate::config::Config::from_toml(
            "[models.\"gpt-5-codex\"]\ncontext_window = 30000\n\
             [models.\"o3-pro\"]\ncontext_window = 200000\n\
             [models.\"my-model\"]\ncontext_window = 8000\n\
             [models.\"gpt-4o-mini\"]\ncontext_window = 64000\nprice = { input = 9.0, output = 9.0 }\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let table = ModelTable::of(&c);
        assert_eq!(table.context_window(Some("gpt-5-codex")), 30_000);
        let shipped =
            ModelTable::of(&crate::config::Config::from_toml("").unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(
            table.price("gpt-5-codex"),
            shipped.price("gpt-5-codex"),
            "the shipped gpt-5-codex* price stays"
        );
        assert!(table.price("gpt-5-codex").is_some());
        // A model the shipped table does not price, or does not know, stays unpriced.
        assert_eq!(table.price("o3-pro"), None);
        assert_eq!(table.price("my-model"), None);
        // A price named is the price.
        assert_eq!(table.price("gpt-4o-mini").map(|p| p.input), Some(9.0));
        // `new` takes the entries as written.
        assert_eq!(ModelTable::new(&c.models, 1000).price("gpt-5-codex"), None);
    }

    #[test]
    fn the_gpt_5_family_is_measured_against_its_input_limit() {
        let c = crate::config::Config::from_toml("").unwrap_or_else(|e| panic!("{e}"));
        let shipped = ModelTable::new(&c.models, c.compaction.default_context_window);
        for model in ["gpt-5", "gpt-5-codex", "gpt-5.1-codex-max", "gpt-5-mini"] {
            assert_eq!(shipped.context_window(Some(model)), 272_000, "{model}");
        }
        assert_eq!(shipped.context_window(Some("gpt-5-chat-latest")), 128_000);
    }

    #[test]
    fn globs_match_any_run() {
        assert!(Glob::new("gpt-4o*").matches("gpt-4o"));
        assert!(Glob::new("gpt-4o*").matches("gpt-4o-mini-2024"));
        assert!(Glob::new("*llama-3.1*").matches("meta-llama/llama-3.1-70b"));
        assert!(Glob::new("a*b*c").matches("axxbyyc"));
        assert!(Glob::new("a*b*c").matches("abc"));
        assert!(Glob::new("*").matches(""));
        assert!(Glob::new("GPT-*").matches("gpt-5"), "ASCII case is ignored");
        assert!(!Glob::new("gpt-4o*").matches("gpt-4"));
        assert!(!Glob::new("a*b*c").matches("axxbyy"));
        assert!(!Glob::new("abc").matches("abcd"));
        assert!(!Glob::new("").matches("a"));
    }

    #[test]
    fn exact_name_wins_then_longest_glob() {
        let t = table(&[
            ("gpt-4", 8192),
            ("gpt-4*", 1),
            ("gpt-4o*", 128_000),
            ("gpt-4o-mini*", 64_000),
            ("*", 5),
        ]);
        assert_eq!(t.lookup("gpt-4"), Some(8192), "exact beats every glob");
        assert_eq!(t.lookup("gpt-4o-2024-08-06"), Some(128_000));
        assert_eq!(t.lookup("gpt-4o-mini"), Some(64_000), "longest glob wins");
        assert_eq!(t.lookup("gpt-4-turbo"), Some(1));
        assert_eq!(t.lookup("something"), Some(5));
    }

    #[test]
    fn unknown_or_missing_models_use_the_default() {
        let t = table(&[("claude-*", 200_000)]);
        assert_eq!(t.context_window(Some("mystery")), 1000);
        assert_eq!(t.context_window(None), 1000);
        assert_eq!(t.context_window(Some("")), 1000);
        assert_eq!(t.context_window(Some("Claude-Sonnet-4")), 200_000);
    }

    #[test]
    fn aggregator_prefixes_are_retried_without_the_provider() {
        let t = table(&[("gpt-4o*", 128_000), ("*qwen3*", 131_072)]);
        assert_eq!(t.lookup("openai/gpt-4o"), Some(128_000));
        assert_eq!(
            t.lookup("qwen/qwen3-coder"),
            Some(131_072),
            "full name matches first"
        );
        assert_eq!(t.lookup("x/unknown"), None);
    }

    fn learned(context_window: usize, source: WindowSource) -> LearnedWindow {
        LearnedWindow {
            context_window,
            source,
            learned_unix: 1,
        }
    }

    #[test]
    fn a_refusal_replaces_what_was_known_and_usage_only_raises_it() {
        let error = |w| learned(w, WindowSource::Error);
        let usage = |w| learned(w, WindowSource::Usage);
        assert_eq!(error(16_385).merged_into(None), Some(error(16_385)));
        assert_eq!(
            error(8_192).merged_into(Some(error(16_385))),
            Some(error(8_192))
        );
        assert_eq!(
            error(16_385).merged_into(Some(error(16_385))),
            None,
            "nothing new"
        );
        assert_eq!(
            error(20_000).merged_into(Some(usage(20_000))),
            Some(error(20_000))
        );
        assert_eq!(
            usage(20_000).merged_into(Some(error(16_385))),
            Some(usage(20_000))
        );
        assert_eq!(
            usage(10_000).merged_into(Some(error(16_385))),
            None,
            "a floor never lowers"
        );
        assert_eq!(usage(0).merged_into(None), None);
        assert_eq!(error(0).merged_into(Some(error(5))), None);
        // The size of a request refused without a named window is a ceiling: it only lowers.
        let refused = |w| learned(w, WindowSource::Refused);
        assert_eq!(refused(30_000).merged_into(None), Some(refused(30_000)));
        assert_eq!(
            refused(30_000).merged_into(Some(usage(40_000))),
            Some(refused(30_000))
        );
        assert_eq!(
            refused(50_000).merged_into(Some(refused(30_000))),
            None,
            "a ceiling never raises"
        );
        assert_eq!(
            usage(35_000).merged_into(Some(refused(30_000))),
            Some(usage(35_000)),
            "a request that fitted beats an estimate's ceiling"
        );
    }

    #[test]
    fn model_keys_are_trimmed_lowercased_and_bounded() {
        assert_eq!(model_key(" GPT-4o "), "gpt-4o");
        let long = "é".repeat(100);
        let key = model_key(&long);
        assert!(key.len() <= MAX_MODEL_KEY_LEN);
        assert_eq!(key.chars().count(), MAX_MODEL_KEY_LEN / 2);
    }

    #[test]
    fn shipped_table_answers_common_models() {
        let config = crate::config::Config::from_toml("").expect("defaults load");
        let t = ModelTable::new(&config.models, config.compaction.default_context_window);
        assert_eq!(t.context_window(Some("gpt-4o")), 128_000);
        assert_eq!(t.context_window(Some("gpt-4")), 8192);
        assert_eq!(t.context_window(Some("claude-sonnet-4-20250514")), 200_000);
        assert_eq!(t.context_window(Some("unknown-model")), 128_000);
    }
}
