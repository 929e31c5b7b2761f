//! Learned context windows, per upstream and model, bounded: the in-memory table a store
//! keeps them in.
//!
//! Model names come from clients, so the table holds at most [`MAX_LEARNED_WINDOWS`] windows;
//! when full, the one learned least recently is forgotten (it is learned again from its next
//! refusal). Keys are [`WindowKey`]s. What replaces what is [`LearnedWindow::merged_into`]'s
//! rule.

use std::collections::HashMap;

use crate::compaction::models::{LearnedWindow, WindowKey};

/// Windows kept at most.
pub const MAX_LEARNED_WINDOWS: usize = 256;

/// Learned windows by key.
#[derive(Debug, Default)]
pub struct LearnedWindows {
    windows: HashMap<WindowKey, (LearnedWindow, u64), foldhash::fast::RandomState>,
    /// Logical clock for least-recently-learned eviction.
    tick: u64,
}

impl LearnedWindows {
    /// The window learned for `model` on `upstream`, if any.
    pub fn get(&self, upstream: &str, model: &str) -> Option<LearnedWindow> {
        if self.windows.is_empty() {
            return None;
        }
        let key = WindowKey::new(upstream, model)?;
        self.windows.get(&key).map(|(w, _)| *w)
    }

    /// Learns `window` for `key`; true when it changed what was known.
    pub fn learn(&mut self, key: WindowKey, window: LearnedWindow) -> bool {
        let known = self.windows.get(&key).map(|(w, _)| *w);
        let Some(merged) = window.merged_into(known) else {
            return false;
        };
        if known.is_none() && self.windows.len() >= MAX_LEARNED_WINDOWS {
            let oldest = self
                .windows
                .iter()
                .min_by_key(|(_, (_, tick))| *tick)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.windows.remove(&oldest);
            }
        }
        self.tick += 1;
        self.windows.insert(key, (merged, self.tick));
        true
    }

    /// Every learned window, most recently learned first.
    pub fn list(&self) -> Vec<(WindowKey, LearnedWindow)> {
        let mut all: Vec<_> = self
            .windows
            .iter()
            .map(|(k, (w, tick))| (*tick, k.clone(), *w))
            .collect();
        all.sort_by_key(|(tick, _, _)| std::cmp::Reverse(*tick));
        all.into_iter().map(|(_, k, w)| (k, w)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::models::WindowSource;

    fn error(context_window: usize) -> LearnedWindow {
        LearnedWindow {
            context_window,
            source: WindowSource::Error,
            learned_unix: 7,
        }
    }

    const UP: &str = "https://api.example";

    fn key(upstream: &str, model: &str) -> WindowKey {
        WindowKey::new(upstream, model).unwrap_or_else(|| panic!("a key for {model:?}"))
    }

    #[test]
    fn windows_are_found_by_upstream_and_model_key_and_listed_newest_first() {
        let mut t = LearnedWindows::default();
        assert!(t.learn(key(UP, "Local-16K"), error(16_384)));
        assert!(t.learn(key(UP, "other"), error(8_192)));
        assert!(!t.learn(key(UP, "local-16k"), error(16_384)), "nothing new");
        assert_eq!(t.get(UP, " local-16k"), Some(error(16_384)));
        assert_eq!(
            t.get("https://api.example/", "local-16k"),
            Some(error(16_384))
        );
        assert_eq!(t.get(UP, "missing"), None);
        // The same model behind another upstream is another deployment: nothing learned.
        assert_eq!(t.get("http://127.0.0.1:8000", "local-16k"), None);
        assert!(t.learn(key("http://127.0.0.1:8000", "local-16k"), error(4_096)));
        assert_eq!(t.get(UP, "local-16k"), Some(error(16_384)));
        let listed: Vec<(String, String)> = t
            .list()
            .into_iter()
            .map(|(k, _)| (k.upstream().to_string(), k.model().to_string()))
            .collect();
        let pair = |u: &str, m: &str| (u.to_string(), m.to_string());
        assert_eq!(
            listed,
            [
                pair("http://127.0.0.1:8000", "local-16k"),
                pair(UP, "other"),
                pair(UP, "local-16k")
            ]
        );
        assert_eq!(WindowKey::new(UP, "  "), None, "no model, no key");
    }

    #[test]
    fn stored_keys_without_an_upstream_are_not_read_back() {
        assert_eq!(WindowKey::from_stored("gpt-4o".into()), None);
        assert_eq!(WindowKey::from_stored(" gpt-4o".into()), None);
        let k = key(UP, "GPT-4o");
        assert_eq!(WindowKey::from_stored(k.as_str().to_string()), Some(k));
    }

    #[test]
    fn the_table_is_bounded_and_forgets_the_least_recently_learned() {
        let mut t = LearnedWindows::default();
        for i in 0..MAX_LEARNED_WINDOWS {
            assert!(t.learn(key(UP, &format!("m{i}")), error(1_000 + i)));
        }
        // Relearning m0 makes m1 the oldest.
        assert!(t.learn(key(UP, "m0"), error(5)));
        assert!(t.learn(key(UP, "new"), error(42)));
        assert_eq!(t.list().len(), MAX_LEARNED_WINDOWS);
        assert_eq!(t.get(UP, "m1"), None, "least recently learned is forgotten");
        assert_eq!(t.get(UP, "m0"), Some(error(5)));
        assert_eq!(t.get(UP, "new"), Some(error(42)));
    }
}
