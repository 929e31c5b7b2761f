//! Limits and context windows: the limits a request is measured against, from the models
//! table or a window learned from a provider's refusal (kept in the store).

use super::*;

impl Pipeline {
    /// The limits of a request to `upstream`: for the window learned for its model there when
    /// there is one (a provider's own figure beats the table), with the token threshold in raw
    /// estimate units: divided by the model's calibration factor when calibration is on. The
    /// trigger and the engine both compare raw estimates with these limits, so a rewrite the
    /// engine sizes to fit does not trip the trigger again on the next request.
    pub(super) async fn limits(
        &self,
        upstream: &str,
        model: Option<&str>,
        long_context: bool,
        requested_output: Option<usize>,
    ) -> Limits {
        let window_model = model.map(|m| window_model(m, long_context));
        let limits = self
            .window_limits(upstream, window_model.as_deref(), requested_output)
            .await;
        // The summarizer's call does not carry the request's long-context flag: its prompt
        // and summary fit the model's usual window.
        let limits = if long_context {
            let usual = self.window_limits(upstream, model, requested_output).await;
            limits.with_summarizer_window(usual.context_window)
        } else {
            limits
        };
        match model {
            Some(model) if self.calibrate => limits.calibrated(self.calibration.factor(model)),
            _ => limits,
        }
    }

    /// The limits for the window of `model` (a [`window_model`] name) on `upstream`: the one
    /// learned there, else the table's.
    pub(super) async fn window_limits(
        &self,
        upstream: &str,
        model: Option<&str>,
        requested_output: Option<usize>,
    ) -> Limits {
        let learned = match model {
            Some(name) => self.learned_window(upstream, name).await,
            None => None,
        };
        match learned {
            Some(w) => Limits::new(self.engine.settings(), w.context_window, requested_output),
            None => self.engine.limits(model, requested_output),
        }
    }

    /// The window learned for `model` on `upstream`; a store that cannot answer is as if
    /// nothing was learned.
    pub(super) async fn learned_window(
        &self,
        upstream: &str,
        model: &str,
    ) -> Option<LearnedWindow> {
        let learned = self.store.learned_window(upstream, model).await;
        learned.unwrap_or_else(|e| {
            tracing::debug!(error = %e, "learned windows unavailable; using the models table");
            None
        })
    }

    /// Remembers a window the provider at `upstream` showed for `model` (counted when it
    /// changed what was known), so the trigger uses it from the next request to that upstream
    /// on, wherever the store is shared.
    pub async fn learn_window(
        &self,
        upstream: &str,
        model: &str,
        context_window: usize,
        source: WindowSource,
    ) {
        let Some(key) = WindowKey::new(upstream, model) else {
            return;
        };
        let window = LearnedWindow {
            context_window,
            source,
            learned_unix: crate::session::store::unix_now(),
        };
        match self.store.learn_window(&key, window).await {
            Ok(true) => {
                self.metrics.window_learned(source);
                tracing::info!(
                    upstream,
                    model,
                    context_window,
                    source = source.label(),
                    "context window learned"
                );
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "learned window not stored"),
        }
    }

    /// The windows learned from providers, most recently learned first (`GET /models`).
    pub async fn windows(&self) -> Result<Vec<(WindowKey, LearnedWindow)>, StoreError> {
        self.store.learned_windows().await
    }
}
