//! Compact-and-retry: a request the provider refused for length compacted further (beyond
//! what was forwarded) and sent again, and what the retry's answer teaches.

use super::*;

impl Pipeline {
    /// Compacts a chat request the provider refused for its length, to send it once more:
    /// forced, to the window the refusal named (if any), and smaller than what was refused
    /// (`forwarded`, the estimate of the body that was sent). The checkpoint is stored, so the
    /// conversation's next requests splice it. `None` when no smaller request can be made
    /// (counted, and a failure of the conversation's breaker); never fails otherwise, and a
    /// panic is caught and counted. Whether the smaller request worked is the provider's to say:
    /// report its answer with [`Pipeline::retry_answered`].
    pub async fn compact_after_refusal(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
        refusal: Overflow,
        forwarded: usize,
    ) -> Option<Smaller> {
        let compacted = AssertUnwindSafe(
            self.compact_after_refusal_unguarded(dialect, body, context, refusal, forwarded),
        )
        .catch_unwind()
        .await;
        compacted.unwrap_or_else(|_| {
            self.record(Trigger::Overflow, CompactionOutcome::Panic);
            tracing::error!("compaction after a refusal for length panicked");
            None
        })
    }

    pub(super) async fn compact_after_refusal_unguarded(
        &self,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
        refusal: Overflow,
        forwarded: usize,
    ) -> Option<Smaller> {
        let scan = dialect
            .scan(body, self.engine.estimator())
            .ok()?
            .with_model_from_prefix(&context.caller.api_prefix);
        let tenant = TenantId::from_caller(context.caller);
        let session = self
            .session_of(&scan, &tenant, context.session_header)
            .await;
        if let Some(model) = scan.model.as_deref() {
            let upstream = &context.caller.upstream_base_url;
            // A refusal that names no window still bounds it: the refused request did not fit.
            // Only a bound below the window in use teaches anything.
            let learned = match refusal.window {
                Some(window) => Some((window, WindowSource::Error)),
                None => {
                    let asked = forwarded.saturating_add(scan.requested_output.unwrap_or(0));
                    let in_use = self
                        .limits(upstream, Some(model), context.long_context, None)
                        .await
                        .context_window;
                    (asked < in_use).then_some((asked, WindowSource::Refused))
                }
            };
            if let Some((window, source)) = learned {
                let model = window_model(model, context.long_context);
                self.learn_window(upstream, &model, window, source).await;
            }
        }
        let limits = self
            .limits(
                &context.caller.upstream_base_url,
                scan.model.as_deref(),
                context.long_context,
                scan.requested_output,
            )
            .await
            .after_refusal(
                self.engine.settings(),
                refusal.window,
                refusal.requested,
                forwarded,
            );
        let request = Request {
            scan: &scan,
            body,
            caller: context.caller,
            tenant,
            session: &session,
            limits,
            background_at: None,
            slow_summaries: false,
            attempts: context.attempts,
            pays: false,
        };
        if context.attempts.left() == 0 {
            // The compaction before the request was sent made every call the request may.
            self.record(Trigger::Overflow, CompactionOutcome::Failed);
            tracing::warn!(
                session,
                "refused for length after this request made every summarizer call it may; not compacted again"
            );
            return None;
        }
        if !self.breaker_allows(tenant, &session).await {
            self.record(Trigger::Overflow, CompactionOutcome::Breaker);
            tracing::warn!(
                session,
                "refused for length while the session breaker is open; not compacted again"
            );
            return None;
        }
        let Ok(transcript) = transcript_to_summarise(&scan, request.limits.opening_budget) else {
            self.record(Trigger::Overflow, CompactionOutcome::Failed);
            return None;
        };
        let started = Instant::now();
        let compacted = self.compact_now(&request, &transcript, None, started).await;
        let smaller = matches!(&compacted, Ok(c) if c.compaction.result.post_tokens < forwarded);
        if !smaller {
            self.feed_breaker(tenant, &session, false).await;
        }
        match compacted {
            Ok(Compacted {
                body, compaction, ..
            }) if compaction.result.post_tokens < forwarded => {
                self.record(Trigger::Overflow, CompactionOutcome::Compacted);
                self.history.record(
                    &session,
                    Point::now(
                        scan.tokens,
                        compaction.result.post_tokens,
                        request.limits.token_threshold,
                        Done::Retried,
                        compaction.result.compaction_num,
                    ),
                );
                self.log_compaction(
                    &session,
                    Trigger::Overflow,
                    scan.len(),
                    &compaction,
                    started,
                );
                Some(Smaller {
                    body: Bytes::from(body),
                    tenant,
                    session,
                })
            }
            Ok(_) => {
                self.record(Trigger::Overflow, CompactionOutcome::Failed);
                tracing::warn!(
                    session,
                    "compaction after a refusal for length was not smaller than what was refused"
                );
                None
            }
            Err(e) => {
                self.record(Trigger::Overflow, e.outcome());
                self.log_failure(&session, Trigger::Overflow, e.outcome());
                tracing::warn!(session, error = %e, "compaction after a refusal for length failed");
                None
            }
        }
    }

    /// How the provider answered a request compacted after a refusal for length: a success of
    /// the conversation's breaker unless it refused the smaller request for its length too
    /// (a conversation that cannot be brought under the provider's window stops calling the
    /// summarizer after three such refusals, as after three failed compactions).
    pub async fn retry_answered(&self, retried: &Smaller, refused_for_length: bool) {
        if refused_for_length {
            tracing::warn!(
                session = retried.session,
                "the compacted request was refused for its length too; counted toward the session breaker"
            );
        }
        self.feed_breaker(retried.tenant, &retried.session, !refused_for_length)
            .await;
    }
}
