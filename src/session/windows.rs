//! Learned context windows, per model, bounded: the in-memory table a store keeps them in.
//!
//! Model names come from clients, so the table holds at most [`MAX_LEARNED_WINDOWS`] models;
//! when full, the model whose window was learned least recently is forgotten (it is learned
//! again from its next refusal). Keys are [`model_key`]s. What replaces what is
//! [`LearnedWindow::merged_into`]'s rule.

use std::collections::HashMap;

use crate::compaction::models::{model_key, LearnedWindow};

/// Models whose learned window is kept at most.
pub const MAX_LEARNED_WINDOWS: usize = 256;

/// Learned windows by model key.
#[derive(Debug, Default)]
pub struct LearnedWindows {
    models: HashMap<String, (LearnedWindow, u64)>,
    /// Logical clock for least-recently-learned eviction.
    tick: u64,
}

impl LearnedWindows {
    /// The window learned for `model`, if any.
    pub fn get(&self, model: &str) -> Option<LearnedWindow> {
        if self.models.is_empty() {
            return None;
        }
        self.models.get(&model_key(model)).map(|(w, _)| *w)
    }

    /// Learns `window` for `model`; true when it changed what was known.
    pub fn learn(&mut self, model: &str, window: LearnedWindow) -> bool {
        let key = model_key(model);
        if key.is_empty() {
            return false;
        }
        let known = self.models.get(&key).map(|(w, _)| *w);
        let Some(merged) = window.merged_into(known) else {
            return false;
        };
        if known.is_none() && self.models.len() >= MAX_LEARNED_WINDOWS {
            let oldest = self
                .models
                .iter()
                .min_by_key(|(_, (_, tick))| *tick)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.models.remove(&oldest);
            }
        }
        self.tick += 1;
        self.models.insert(key, (merged, self.tick));
        true
    }

    /// Every learned window, most recently learned first.
    pub fn list(&self) -> Vec<(String, LearnedWindow)> {
        let mut all: Vec<_> = self
            .models
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

    #[test]
    fn windows_are_found_by_model_key_and_listed_newest_first() {
        let mut t = LearnedWindows::default();
        assert!(t.learn("Local-16K", error(16_384)));
        assert!(t.learn("other", error(8_192)));
        assert!(!t.learn("local-16k", error(16_384)), "nothing new");
        assert_eq!(t.get(" local-16k"), Some(error(16_384)));
        assert_eq!(t.get("missing"), None);
        let names: Vec<String> = t.list().into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["other", "local-16k"]);
        assert!(!t.learn("  ", error(1)), "no model, nothing learned");
    }

    #[test]
    fn the_table_is_bounded_and_forgets_the_least_recently_learned() {
        let mut t = LearnedWindows::default();
        for i in 0..MAX_LEARNED_WINDOWS {
            assert!(t.learn(&format!("m{i}"), error(1_000 + i)));
        }
        // Relearning m0 makes m1 the oldest.
        assert!(t.learn("m0", error(5)));
        assert!(t.learn("new", error(42)));
        assert_eq!(t.list().len(), MAX_LEARNED_WINDOWS);
        assert_eq!(t.get("m1"), None, "least recently learned is forgotten");
        assert_eq!(t.get("m0"), Some(error(5)));
        assert_eq!(t.get("new"), Some(error(42)));
    }
}
