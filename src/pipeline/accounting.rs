//! What each request is counted as: tokens received and forwarded per cohort, what shadow
//! mode would have forwarded, and the rent the cost trigger charges a conversation's old turns.

use std::sync::atomic::Ordering;

use super::*;

impl Pipeline {
    /// Token metrics of one request, and the estimate its response's usage is compared with;
    /// `memo`: what the scan memo did for it.
    pub(super) fn record_tokens(
        &self,
        request: &Request<'_, '_>,
        long_context: bool,
        memo: &MemoUse,
        processed: &mut Processed,
    ) {
        let scan = request.scan;
        let received = scan.tokens;
        let forwarded = match &processed.outcome {
            Outcome::Rewritten { result, .. } | Outcome::Reused { result, .. } => {
                result.post_tokens
            }
            Outcome::Masked { post_tokens, .. } => *post_tokens,
            Outcome::Unchanged | Outcome::Failed => received,
        };
        self.metrics.chat_request_tokens(
            scan.dialect(),
            received,
            forwarded,
            request.limits.context_window,
        );
        // Every way a request is made smaller counts: a new summary, a stored one spliced in
        // (made on the request path or ahead of it), masked outputs.
        let saved = received.saturating_sub(forwarded);
        self.metrics
            .tokens_saved
            .inc_by(u64::try_from(saved).unwrap_or(u64::MAX));
        // What the request as received would cost is worked out only for a priced model.
        let price = scan
            .model
            .as_deref()
            .and_then(|m| self.engine.models().price(&window_model(m, long_context)));
        let received_cached = if price.is_some() {
            let repeated = self.repeats.repeated(
                &request.tenant,
                request.session,
                &scan.messages,
                memo.known.load(Ordering::Relaxed),
                memo.held.load(Ordering::Relaxed),
            );
            let bytes = |messages: &[&str]| messages.iter().map(|m| m.len()).sum::<usize>();
            let all = bytes(&scan.messages).max(1);
            // `as` saturates; the share is at most 1.
            cached_prefix(
                (received as f64 * bytes(&scan.messages[..repeated]) as f64 / all as f64) as usize,
            )
        } else {
            0
        };
        processed.estimate = Some(ForwardedEstimate {
            dialect: scan.dialect(),
            model: scan.model.clone(),
            price,
            tokens: forwarded,
            received,
            received_cached,
            context_window: request.limits.context_window,
            caller: request.caller.clone(),
            long_context,
            cohort: processed.cohort,
        });
    }

    /// What the shadow pipeline would forward for this request, in estimated input tokens:
    /// it decides as enforce would, with its own summaries and store ([`shadow`]); `None`
    /// without a shadow or for a body it does not read.
    pub(super) async fn shadow_forwarded(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Option<usize> {
        let shadow = self.shadow.as_ref()?;
        let attempts = Attempts::per_request();
        let context = RequestContext {
            mode: Some(Mode::Enforce),
            attempts: &attempts,
            ..*context
        };
        // Boxed: the shadow runs this same function.
        let decided = Box::pin(shadow.handle(dialect, body, &context)).await;
        decided.estimate.map(|e| e.tokens)
    }

    /// Adds what the request's cached history cost to its conversation's rent ([`payback`]),
    /// for a priced model when the cost trigger is on, forwarded in `shape` with `summary` in
    /// it (if any).
    pub(super) fn pay_rent(
        &self,
        request: &Request<'_, '_>,
        shape: Shape,
        summary: Option<&str>,
        estimate: Option<&ForwardedEstimate>,
    ) {
        let (Some(payback), Some(estimate)) = (&self.payback, estimate) else {
            return;
        };
        let Some(price) = estimate.price else {
            return;
        };
        let Some(economics) = Economics::of(&price, estimate.dialect == DialectKind::Messages)
        else {
            return;
        };
        // Without a summary yet, a first compaction adds one and a tail (the smallest: it is
        // one that pays) to what the conversation started with.
        let extra = if shape.summary > 0 {
            0
        } else {
            self.engine.settings().min_preserve_tokens + payback::SUMMARY_TOKENS
        };
        payback.observe(
            &(request.tenant, request.session),
            shape,
            (estimate.received, estimate.tokens),
            extra,
            &economics,
            || summary.map(|s| self.engine.estimator().text(s)),
        );
    }
}
