//! One compaction: the engine run on the request beyond any stored summary (its first
//! summarizer call asked inside the conversation where that pays), the rewrite, the checkpoint
//! stored; the conversation's breaker, the claim across replicas, and how a compaction is
//! logged and counted.

use super::*;

/// The transcript a compaction reads: `scan`'s, with each tool output cut to what a
/// compaction prompt can show of it ([`OUTPUT_CHARS_READ`]).
pub(super) fn transcript_to_summarise(
    scan: &Scan<'_>,
    opening_budget: usize,
) -> Result<Transcript, DialectError> {
    scan.transcript_cutting_outputs(opening_budget, OUTPUT_CHARS_READ)
}

impl Pipeline {
    /// Whether the conversation's breaker lets a compaction run now. Every path that may call
    /// the summarizer asks (the trigger, a refusal for length, a summary made ahead, a manual
    /// compaction), so one breaker bounds a conversation whatever starts the attempt. A store
    /// that cannot answer lets it run.
    pub(super) async fn breaker_allows(&self, tenant: TenantId, session: &str) -> bool {
        self.store
            .compaction_allowed(tenant, session)
            .await
            .unwrap_or(true)
    }

    /// Tells the conversation's breaker how an attempt it allowed ended (see
    /// [`Pipeline::breaker_allows`]); counts and logs the breaker opening.
    pub(super) async fn feed_breaker(&self, tenant: TenantId, session: &str, succeeded: bool) {
        if let Ok(true) = self
            .store
            .record_compaction(tenant, session, succeeded)
            .await
        {
            self.metrics.breaker_open.inc();
            tracing::warn!(session, "session breaker open: automatic compaction paused");
        }
    }

    /// A compaction that is not the trigger's (manual, or after a refusal for length):
    /// beyond any stored checkpoint, timed from `started`.
    pub(super) async fn compact_now(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        instructions: Option<&str>,
        started: Instant,
    ) -> Result<Compacted, Failure> {
        let splice = self.stored_splice(request).await;
        let result = self
            .compact_and_store(request, transcript, splice.as_ref(), instructions, None)
            .await;
        self.metrics
            .compaction_duration
            .observe(started.elapsed().as_secs_f64());
        result
    }

    /// Compacts (beyond any spliced prefix), rewrites, and stores the new checkpoint.
    pub(super) async fn compact_and_store(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        splice: Option<&Splice>,
        instructions: Option<&str>,
        forwarded: Option<Forwarded<'_>>,
    ) -> Result<Compacted, Failure> {
        let mut compaction = self
            .compact_view(request, transcript, splice, instructions, forwarded)
            .await?;
        let summary = (
            compaction.head,
            compaction.boundary,
            compaction.summary_message.as_str(),
        );
        // The tail after the new summary is masked by the same rule as any later request's.
        let view = (compaction.counted, compaction.result.post_tokens);
        let mut mask = self
            .plan_mask(request, Some(compaction.boundary), view, None)
            .await;
        let body = match request.scan.rewrite_with(Some(summary), &mask.edits) {
            Ok(body) => body,
            Err(e) if !mask.edits.is_empty() => {
                self.metrics.mask_failed(request.scan.dialect());
                tracing::warn!(error = %e, "masking old outputs failed; forwarding them as sent");
                mask = Masking::default();
                request.scan.rewrite(summary.0, summary.1, summary.2)?
            }
            Err(e) => return Err(e.into()),
        };
        let stored = self.store_checkpoint(request, &compaction, None).await;
        compaction.result.post_tokens = compaction.result.post_tokens.saturating_sub(mask.saved);
        Ok(Compacted {
            body,
            compaction,
            stored,
            masked: mask.masked(),
        })
    }

    /// Compacts the request beyond any spliced prefix: the engine's result, its boundary
    /// counted in the request's own messages. With the request as `forwarded`, the first
    /// summarizer call may be asked inside it: when it fits the window beside the answer (with
    /// a twentieth to spare for the estimate's error) and costs less than the standalone
    /// prompt at the model's prices, the forwarded request read from the provider's cache as
    /// the agents' own compaction reads it (GPT-4o's cache at half the input price makes a
    /// conversation of full tool outputs dearer than a prompt of truncated ones; a tenth
    /// makes it far cheaper). A model without a price is asked inside, as the agents ask.
    pub(super) async fn compact_view(
        &self,
        request: &Request<'_, '_>,
        transcript: &Transcript,
        splice: Option<&Splice>,
        instructions: Option<&str>,
        forwarded: Option<Forwarded<'_>>,
    ) -> Result<Compaction, CompactError> {
        let scan = request.scan;
        let estimator = self.engine.estimator();
        let window = request.limits.summarizer_window;
        let room = window.saturating_sub(window / 20);
        let dialect = scan.dialect();
        let price = scan
            .model
            .as_deref()
            .and_then(|m| self.engine.models().price(m));
        let ask = |turn: &str, max_output: u32, prompt_tokens: usize| -> Option<Arc<[u8]>> {
            let f = forwarded?;
            let turn_tokens = estimator.text(turn);
            let needed = f.tokens.saturating_add(turn_tokens);
            if needed.saturating_add(max_output as usize) > room {
                return None;
            }
            if let Some(p) = price {
                let inside = f.tokens as f64 * p.cache_read() + turn_tokens as f64 * p.input;
                if inside >= prompt_tokens as f64 * p.input {
                    return None;
                }
            }
            match dialect.ask_for_summary(f.body, turn, max_output) {
                Ok((body, asked)) if needed.saturating_add(asked) <= room => Some(body.into()),
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!(error = %e, "the summary cannot be asked inside this conversation");
                    None
                }
            }
        };
        // The engine sees the conversation without the covered prefix (after the head the
        // stored summary follows); the prior summary travels in `<prior-summary>` and is
        // refined, not repeated.
        let (view, offset) = match splice {
            None => (None, 0),
            Some(s) => (
                Some(transcript.without(s.head..s.covered)),
                s.covered - s.head,
            ),
        };
        // The stored summary is refined, its file lists carried forward.
        let prior = splice.map(|s| Prior {
            summary: s.checkpoint.result.summary.clone(),
            read_files: s.checkpoint.result.read_files.clone(),
            modified_files: s.checkpoint.result.modified_files.clone(),
            compaction_num: s.checkpoint.result.compaction_num,
        });
        let mut compaction = self
            .engine
            .compact(CompactionInput {
                transcript: view.as_ref().unwrap_or(transcript),
                model: scan.model.as_deref(),
                limits: request.limits,
                fixed_tokens: scan.fixed_tokens,
                prior: prior.as_ref(),
                instructions,
                caller: request.caller,
                attempts: request.attempts,
                smallest_tail: request.pays,
                in_conversation: forwarded.is_some().then_some(InConversation(&ask)),
            })
            .await?;
        compaction.boundary += offset;
        self.record_summarizer_cost(request, &compaction).await;
        Ok(compaction)
    }

    /// Adds what a compaction's summaries cost (as the backend reported, at the models
    /// table's prices) to the conversation's cost in the store (the admin API's session
    /// detail). Nothing for a backend that reports nothing or a model without a price.
    pub(super) async fn record_summarizer_cost(
        &self,
        request: &Request<'_, '_>,
        compaction: &Compaction,
    ) {
        let usd = self.summary_usd(compaction);
        if usd <= 0.0 {
            return;
        }
        let cost = SessionCost {
            summarizer_usd: usd,
            ..SessionCost::default()
        };
        if let Err(e) = self
            .store
            .record_cost(request.tenant, request.session, cost)
            .await
        {
            tracing::debug!(error = %e, "summarizer cost not recorded");
        }
    }

    /// What a compaction's summarizer calls cost, in USD (priced models that report usage).
    pub(super) fn summary_usd(&self, compaction: &Compaction) -> f64 {
        let models = self.engine.models();
        compaction
            .usage
            .iter()
            .filter_map(|u| Some(Bill::of(&u.into(), &models.price(&u.model)?).total()))
            .sum()
    }

    /// The single flight of a summary of `request`'s conversation after `splice`.
    pub(super) fn flight_key(
        &self,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
    ) -> FlightKey {
        FlightKey {
            tenant: request.tenant,
            session: request.session.to_string(),
            covered: splice.map_or(0, |s| s.covered),
        }
    }

    /// Claims the compaction of `key`'s prefix across the processes sharing the store, waiting
    /// up to `wait` for another's. `None`: another process held it; what it stored is in the
    /// store. A failing store claims nothing and lets this process compact (fail open: at
    /// worst a second summary of the prefix).
    pub(super) async fn claim(&self, key: &FlightKey, wait: Duration) -> Option<Lease> {
        match self
            .store
            .claim_compaction(key.tenant, &key.session, key.covered, wait)
            .await
        {
            Ok(Claim::Won(lease)) => Some(lease),
            Ok(Claim::Waited) => None,
            Err(e) => {
                tracing::warn!(error = %e, "compaction claim failed; compacting in this process");
                Some(Lease::local())
            }
        }
    }

    pub(super) fn log_compaction(
        &self,
        session: &str,
        trigger: Trigger,
        messages: usize,
        compaction: &Compaction,
        started: Instant,
    ) {
        let r = &compaction.result;
        tracing::info!(
            session,
            trigger = trigger.label(),
            outcome = "compacted",
            messages_before = messages,
            messages_after = compaction.messages,
            tokens_before = r.pre_tokens,
            tokens_after = r.post_tokens,
            compaction_num = r.compaction_num,
            attempts = compaction.attempts,
            summarizer = self.engine.summarizer_name(),
            duration_ms = started.elapsed().as_millis() as u64,
            "compaction"
        );
        if let Some(events) = &self.events {
            let kind = match trigger {
                Trigger::Overflow => event_log::Kind::Retry,
                _ => event_log::Kind::Compaction,
            };
            let usd = self.summary_usd(compaction);
            events.record(
                Event {
                    trigger: Some(trigger.label()),
                    summarizer: Some(self.engine.summarizer_name()),
                    cost_usd: (usd > 0.0).then_some(usd),
                    ..Event::new(kind, session).tokens(r.pre_tokens, r.post_tokens)
                }
                .took(started.elapsed()),
            );
        }
    }

    /// A compaction that was due and did not happen, in the event log.
    pub(super) fn log_failure(&self, session: &str, trigger: Trigger, outcome: CompactionOutcome) {
        if let Some(events) = &self.events {
            events.record(Event {
                trigger: Some(trigger.label()),
                outcome: Some(outcome.label()),
                summarizer: Some(self.engine.summarizer_name()),
                ..Event::new(event_log::Kind::CompactionFailed, session)
            });
        }
    }

    pub(super) fn record(&self, trigger: Trigger, outcome: CompactionOutcome) {
        self.metrics.compaction(trigger, outcome);
    }
}
