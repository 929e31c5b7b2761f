//! Summaries made ahead, off the request path: started at the background watermark or when
//! compacting pays (the cost trigger), made within the single flight of their prefix, and
//! stored staged for a later request to splice. `background` holds the
//! bounded set of tasks.

use super::*;

impl Pipeline {
    /// Below the trigger, where compacting pays ([`payback`]): a summary made ahead is spliced
    /// in if one is ready and makes the request smaller, else one is started in the
    /// background. Either way the request goes on at once: it fits its window.
    pub(super) async fn pay_back(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        staged: Option<Arc<Checkpoint>>,
        mask: &Masking<'_>,
        tokens: usize,
        figures: &mut Figures,
    ) -> Outcome {
        let Some(staged) = staged else {
            self.spawn_background(request, splice, mask, Trigger::Cost);
            return self.reuse(request.scan, splice, mask, tokens, figures);
        };
        if let Ok(Some((ready, ready_mask, _, ready_tokens))) =
            self.staged_view(request, staged).await
        {
            if ready_tokens < tokens {
                self.promote(request, &ready).await;
                return self.reuse(
                    request.scan,
                    Some(&ready),
                    &ready_mask,
                    ready_tokens,
                    figures,
                );
            }
        }
        self.reuse(request.scan, splice, mask, tokens, figures)
    }

    /// Starts the summary of a request over the background watermark (below the trigger) off
    /// the request path, unless background summaries are off; see
    /// [`Pipeline::spawn_background`]. Whether it started one.
    pub(super) fn start_background(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        count: usize,
        tokens: usize,
    ) -> bool {
        let Some(trigger) = request
            .background_at
            .and_then(|soft| soft.check(count, tokens))
        else {
            return false;
        };
        self.spawn_background(request, splice, mask, trigger)
    }

    /// Starts the summary of a request off the request path, unless one of this prefix is
    /// already being made or was tried before (a failed one is not retried: the request
    /// crossing the trigger compacts), or all `summarizer.max_concurrent` slots are taken
    /// (counted `busy`). Whether it started one.
    pub(super) fn spawn_background(
        self: &Arc<Self>,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        trigger: Trigger,
    ) -> bool {
        let key = self.flight_key(request, splice);
        if self.flights.is_running(&key) || !self.background.first_attempt(&key) {
            return false;
        }
        let forwarded = self.forwarded_body(request, splice, mask).map(|body| {
            let body = match body {
                Cow::Borrowed(_) => request.body.clone(),
                Cow::Owned(body) => Bytes::from(body),
            };
            (body, self.view_size(request.scan, splice, mask).1)
        });
        let job = BackgroundJob {
            dialect: request.scan.dialect(),
            body: request.body.clone(),
            caller: request.caller.clone(),
            session: request.session.to_string(),
            limits: request.limits.for_background(self.background_ratio),
            key,
            trigger,
            forwarded,
        };
        let this = self.clone();
        // Running from now, not from when the task is first polled: a request answered before
        // then is never told no summary runs (the gauge is what tests and dashboards wait on).
        let running = Running::start(&self.metrics);
        let key = job.key.clone();
        let started = self.background.spawn(&key, async move {
            let _running = running;
            this.compact_in_background(job).await
        });
        if !started {
            self.metrics.background_compaction(BackgroundOutcome::Busy);
        }
        started
    }

    /// A background summary: made as the request path would make it, within the single
    /// flight of its prefix (so a request crossing the trigger meanwhile waits for it instead
    /// of starting a second), and stored staged unless the conversation was edited meanwhile.
    pub(super) async fn compact_in_background(self: Arc<Self>, job: BackgroundJob) {
        let started = Instant::now();
        let mut outcome = BackgroundOutcome::Failed;
        let slot = &mut outcome;
        let job_ref = &job;
        let this: &Pipeline = &self;
        let flight = self
            .flights
            .run(job.key.clone(), self.flight_wait, move || async move {
                *slot = this.background_summary(job_ref).await;
            })
            .await;
        if flight.is_ok_and(|f| !f.led) {
            // Another compaction of the prefix ran first: nothing left to do.
            outcome = BackgroundOutcome::Skipped;
        }
        self.metrics.background_compaction(outcome);
        if outcome == BackgroundOutcome::Stored {
            self.record(job.trigger, CompactionOutcome::Compacted);
            self.metrics
                .compaction_duration
                .observe(started.elapsed().as_secs_f64());
            self.pace.summary_took(started.elapsed());
        }
        tracing::info!(
            session = job.session,
            trigger = job.trigger.label(),
            outcome = outcome.label(),
            duration_ms = started.elapsed().as_millis() as u64,
            "background compaction"
        );
    }

    pub(super) async fn background_summary(&self, job: &BackgroundJob) -> BackgroundOutcome {
        // Another process compacting this prefix already: leave it to them, without waiting.
        let Some(_lease) = self.claim(&job.key, Duration::ZERO).await else {
            return BackgroundOutcome::Skipped;
        };
        let Ok(scan) = job.dialect.scan(&job.body, self.engine.estimator()) else {
            return BackgroundOutcome::Failed;
        };
        let scan = scan.with_model_from_prefix(&job.caller.api_prefix);
        let Ok(transcript) = transcript_to_summarise(&scan, job.limits.opening_budget) else {
            return BackgroundOutcome::Failed;
        };
        let request = Request {
            scan: &scan,
            body: &job.body,
            caller: &job.caller,
            tenant: job.key.tenant,
            session: &job.session,
            limits: job.limits,
            background_at: None,
            slow_summaries: false,
            attempts: &Attempts::per_request(),
            pays: job.trigger == Trigger::Cost,
        };
        // The checkpoint in use when the job started; one that covers more (another summary
        // finished first) leaves nothing to do.
        let found = self.find_checkpoint(request.tenant, &scan.messages).await;
        let base = match found {
            Some(c) if c.covered > job.key.covered || c.staged.is_some() => {
                return BackgroundOutcome::Skipped
            }
            other => other,
        };
        let splice = match base.map(|c| self.splice(&scan, c)) {
            Some(Ok(Some(s))) => Some(s),
            Some(_) => return BackgroundOutcome::Failed,
            None => None,
        };
        // The conversation's one breaker: a summary made ahead is an attempt like any other.
        if !self.breaker_allows(request.tenant, request.session).await {
            return BackgroundOutcome::Breaker;
        }
        let compacted = self
            .compact_view(
                &request,
                &transcript,
                splice.as_ref(),
                None,
                job.forwarded.as_ref().map(|(body, tokens)| Forwarded {
                    body,
                    tokens: *tokens,
                }),
            )
            .await;
        let compaction = match compacted {
            // Nothing yet worth summarising ahead (the tail the request keeps holds it all, or
            // a summary would not make it smaller): not a failure of the summarizer, so the
            // breaker is not told (a half-open trial this took waits out its cooldown).
            Err(CompactError::NothingToCompact | CompactError::NotSmaller { .. }) => {
                tracing::debug!(session = job.session, "no summary needed ahead yet");
                return BackgroundOutcome::NotNeeded;
            }
            Err(e) => {
                self.feed_breaker(request.tenant, request.session, false)
                    .await;
                self.log_failure(&job.session, job.trigger, e.outcome());
                tracing::warn!(session = job.session, error = %e, "background compaction failed");
                return BackgroundOutcome::Failed;
            }
            Ok(c) => {
                let fits = request
                    .limits
                    .check(c.counted, c.result.post_tokens)
                    .is_none();
                self.feed_breaker(request.tenant, request.session, fits)
                    .await;
                c
            }
        };
        if self.edited_since(&request, compaction.boundary).await {
            return BackgroundOutcome::Discarded;
        }
        let staged = Staged {
            base: splice.map(|s| s.checkpoint),
        };
        match self
            .store_checkpoint(&request, &compaction, Some(staged))
            .await
        {
            Some(_) => BackgroundOutcome::Stored,
            None => BackgroundOutcome::Failed,
        }
    }
}
