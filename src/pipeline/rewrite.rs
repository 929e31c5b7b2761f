//! The rewrite of a request of a followed conversation ([`Pipeline::rewrite_path`]): the
//! stored summary spliced in, old outputs masked, the trigger read on what the upstream would
//! receive, then a summary made ahead spliced, waited for, or made now under the single flight
//! of its prefix; and what a request that waited on another's compaction forwards.

use super::*;

impl Pipeline {
    /// Splices a checkpoint in, and compacts when due: with a staged checkpoint if one is
    /// ready, else by waiting for the summary of the prefix (made by a background task or
    /// another request) or making it. Below the trigger but over the background watermark, the
    /// summary is started in the background and the request goes on at once.
    pub(super) async fn rewrite_path(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        found: Option<Arc<Checkpoint>>,
        figures: &mut Figures,
    ) -> Outcome {
        // A staged checkpoint stands in only for a request over the trigger without it; until
        // then the checkpoint it refines is the one in use.
        let (checkpoint, staged) = match found {
            Some(c) if c.staged.is_some() => {
                (c.staged.as_ref().and_then(|s| s.base.clone()), Some(c))
            }
            other => (other, None),
        };
        let mut splice = match checkpoint.map(|c| self.splice(request.scan, c)) {
            None => None,
            Some(Ok(splice)) => splice,
            Some(Err(e)) => {
                let scan = request.scan;
                let due = request
                    .limits
                    .check(scan.counted(0..scan.len()), scan.tokens);
                return self.not_understood(due, &e);
            }
        };
        // Old outputs are masked first (`mask`, `hybrid`): the trigger reads what the upstream
        // would receive without a new summary.
        let mut mask = self
            .mask_view(request, splice.as_ref(), staged.as_ref())
            .await;
        let (mut count, mut tokens) = self.view_size(request.scan, splice.as_ref(), &mask);
        if self.strategy.masks() {
            figures.masked_tokens = Some(tokens);
        }
        if !self.strategy.summarizes() {
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        }
        let Some(trigger) = request.limits.check(count, tokens) else {
            if request.pays {
                return self
                    .pay_back(request, splice.as_ref(), staged, &mask, tokens, figures)
                    .await;
            }
            if staged.is_none() {
                // `hybrid`: a summary is made ahead only for what masking cannot absorb.
                let most_masked = tokens.saturating_sub(mask.spare);
                self.start_background(request, splice.as_ref(), &mask, count, most_masked);
            }
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        };
        let mut refine_ahead = false;
        if let Some(staged) = staged {
            match self.staged_view(request, staged).await {
                Ok(Some((ready, ready_mask, ready_count, ready_tokens))) => {
                    self.promote(request, &ready).await;
                    if request.limits.check(ready_count, ready_tokens).is_none() {
                        self.metrics.summarizer_wait.observe(0.0);
                        // With slow summaries the next one starts now if the spliced request
                        // is already over the watermark, not a turn later.
                        if request.slow_summaries {
                            let most_masked = ready_tokens.saturating_sub(ready_mask.spare);
                            self.start_background(
                                request,
                                Some(&ready),
                                &ready_mask,
                                ready_count,
                                most_masked,
                            );
                        }
                        return self.reuse(
                            request.scan,
                            Some(&ready),
                            &ready_mask,
                            ready_tokens,
                            figures,
                        );
                    }
                    // Still over: compact further, refining the staged summary (with slow
                    // summaries, in the background below the wait threshold).
                    refine_ahead = request.slow_summaries;
                    splice = Some(ready);
                    mask = ready_mask;
                    (count, tokens) = (ready_count, ready_tokens);
                }
                Ok(None) => {}
                Err(e) => return self.not_understood(Some(trigger), &e),
            }
        }
        // The summary this request needs is being made ahead (or started now to refine the
        // staged one) and the request fits with room to spare: it goes on as it is rather
        // than waiting, and a later request splices the summary once it is ready. (A request
        // that finds another request making it waits for that one: it is due now.)
        if tokens < request.limits.wait_threshold
            && (self
                .background
                .is_running(&self.flight_key(request, splice.as_ref()))
                || refine_ahead
                    && self.start_background(request, splice.as_ref(), &mask, count, tokens))
        {
            self.metrics.compaction_deferred();
            return self.reuse(request.scan, splice.as_ref(), &mask, tokens, figures);
        }
        if !self.breaker_allows(request.tenant, request.session).await {
            self.record(trigger, CompactionOutcome::Breaker);
            return self
                .without_summary(request, splice.as_ref(), mask, figures)
                .await;
        }
        self.compact_due(request, splice, mask, tokens, trigger, figures)
            .await
    }

    /// A request due for a summary with none to be had otherwise: made under the single
    /// flight of its prefix (a request finding another making it waits and splices what that
    /// one stored), claimed across the replicas sharing the store, and forwarded.
    async fn compact_due<'b>(
        self: &Arc<Self>,
        request: &Request<'_, 'b>,
        splice: Option<Splice>,
        mask: Masking<'b>,
        tokens: usize,
        trigger: Trigger,
        figures: &mut Figures,
    ) -> Outcome {
        let transcript = match transcript_to_summarise(request.scan, request.limits.opening_budget)
        {
            Ok(t) => t,
            Err(e) => return self.not_understood(Some(trigger), &e),
        };

        let covered = splice.as_ref().map_or(0, |s| s.covered);
        let key = self.flight_key(request, splice.as_ref());
        let started = Instant::now();
        let forwarded_body = self.forwarded_body(request, splice.as_ref(), &mask);
        let forwarded = forwarded_body
            .as_deref()
            .map(|body| Forwarded { body, tokens });
        // The leader keeps its own result; waiters get `()` and read what it stored.
        let mut led: Option<Result<Compacted, Failure>> = None;
        let slot = &mut led;
        let splice_ref = splice.as_ref();
        let transcript_ref = &transcript;
        let claim_key = key.clone();
        let flight = self
            .flights
            .run(key, self.flight_wait, move || async move {
                // Another process sharing the store may be compacting the same prefix.
                let Some(_lease) = self.claim(&claim_key, self.flight_wait).await else {
                    return;
                };
                // A flight that ended between this request's lookup and now left a newer
                // checkpoint: compacting again would call the summarizer a second time.
                let newer = self
                    .find_checkpoint(request.tenant, &request.scan.messages)
                    .await;
                if newer.is_some_and(|c| c.covered > covered) {
                    return;
                }
                *slot = Some(
                    self.compact_and_store(request, transcript_ref, splice_ref, None, forwarded)
                        .await,
                );
            })
            .await;
        figures.summarizer_time += started.elapsed();
        self.metrics
            .summarizer_wait
            .observe(started.elapsed().as_secs_f64());
        // A request that waited, or found a newer checkpoint, uses what the other one stored.
        let result = match (flight, led) {
            (Ok(f), Some(result)) if f.led => result,
            _ => return self.after_wait(request, trigger, figures).await,
        };
        self.forward_compacted(request, result, (splice, mask), trigger, started, figures)
            .await
    }

    /// What the leader of a compaction forwards: the rewrite (a still-over one counts as a
    /// failure toward the breaker), or after a failure the request with no new summary, as
    /// `view` (the splice and masking it had) gives it.
    async fn forward_compacted<'b>(
        &self,
        request: &Request<'_, 'b>,
        result: Result<Compacted, Failure>,
        (splice, mask): (Option<Splice>, Masking<'b>),
        trigger: Trigger,
        started: Instant,
        figures: &mut Figures,
    ) -> Outcome {
        self.metrics
            .compaction_duration
            .observe(started.elapsed().as_secs_f64());
        if result.is_ok() {
            self.pace.summary_took(started.elapsed());
        }
        // A rewrite still over the trigger makes the next request compact again: it is
        // forwarded (it is smaller and valid) but counts as a failure toward the breaker, so a
        // conversation that cannot be brought under its limits stops calling the summarizer.
        let succeeded = match &result {
            Ok(c) => !c.still_over(&request.limits),
            Err(_) => false,
        };
        let session = request.session;
        self.feed_breaker(request.tenant, session, succeeded).await;
        match result {
            Ok(Compacted {
                body,
                compaction,
                masked,
                ..
            }) => {
                self.record(trigger, CompactionOutcome::Compacted);
                figures.masked_outputs = masked;
                if !succeeded {
                    tracing::warn!(
                        session,
                        tokens_after = compaction.result.post_tokens,
                        "compacted request is still over the trigger; counted toward the session breaker"
                    );
                }
                let mut result = compaction.result.clone();
                result.pre_tokens = request.scan.tokens;
                self.log_compaction(session, trigger, request.scan.len(), &compaction, started);
                Outcome::Rewritten {
                    body: Bytes::from(body),
                    result,
                    trigger,
                }
            }
            Err(e) => {
                let outcome = e.outcome();
                self.record(trigger, outcome);
                self.log_failure(session, trigger, outcome);
                tracing::warn!(
                    session,
                    trigger = trigger.label(),
                    outcome = outcome.label(),
                    error = %e,
                    "compaction failed; forwarding the request without a new summary"
                );
                match self
                    .without_summary(request, splice.as_ref(), mask, figures)
                    .await
                {
                    Outcome::Unchanged => Outcome::Failed,
                    reused => reused,
                }
            }
        }
    }

    /// After waiting on another request's compaction: splice whatever it stored. A request
    /// that needed compaction and is still over its limits afterwards (the other compaction
    /// failed, stored nothing, or covers too little) is counted and logged as failed, never
    /// forwarded silently.
    pub(super) async fn after_wait(
        &self,
        request: &Request<'_, '_>,
        trigger: Trigger,
        figures: &mut Figures,
    ) -> Outcome {
        let scan = request.scan;
        let splice = self.stored_splice(request).await;
        if let Some(s) = &splice {
            // What it waited for may have been a background summary: needed now.
            self.promote(request, s).await;
        }
        let mask = self.mask_view(request, splice.as_ref(), None).await;
        let (count, tokens) = self.view_size(scan, splice.as_ref(), &mask);
        let outcome = self.reuse(scan, splice.as_ref(), &mask, tokens, figures);
        if request.limits.check(count, tokens).is_none() {
            return outcome;
        }
        self.record(trigger, CompactionOutcome::Failed);
        tracing::warn!(
            session = request.session,
            trigger = trigger.label(),
            messages = count,
            tokens,
            "compaction due but the concurrent compaction this request waited for did not bring it under the limits"
        );
        match outcome {
            Outcome::Unchanged => Outcome::Failed,
            reused => reused,
        }
    }
}
