//! The request path: a chat request read once, its conversation and cohort found, then
//! forwarded as received, with a stored summary spliced in, or compacted ([`Pipeline::handle`]);
//! a panic anywhere in it is caught and the original forwarded.

use super::*;

impl Pipeline {
    /// [`Pipeline::handle`] without a session header, returning only the outcome.
    pub async fn process(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &[u8],
        caller: &Arc<Caller>,
    ) -> Outcome {
        let context = RequestContext {
            caller,
            session_header: None,
            long_context: false,
            attempts: &Attempts::per_request(),
            mode: None,
        };
        self.handle(dialect, &Bytes::copy_from_slice(body), &context)
            .await
            .outcome
    }

    /// Decides what to forward for one chat request. Never fails, and never takes the request
    /// down with it: a panic anywhere in compaction (a bug) is caught here, counted as
    /// `{trigger="none",outcome="panic"}`, and the original bytes are forwarded.
    pub async fn handle(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Processed {
        // Unwind safety: after a panic nothing of this request's state is used again, and the
        // shared state (store, flights, calibration) recovers its locks from poisoning.
        let handled = AssertUnwindSafe(self.handle_unguarded(dialect, body, context))
            .catch_unwind()
            .await;
        handled.unwrap_or_else(|_| {
            self.metrics.compaction_panicked();
            tracing::error!("compaction panicked; forwarding the original request unchanged");
            Processed::default()
        })
    }

    pub(super) async fn handle_unguarded(
        self: &Arc<Self>,
        dialect: DialectKind,
        body: &Bytes,
        context: &RequestContext<'_>,
    ) -> Processed {
        if !self.enabled {
            return Processed::default();
        }
        let tenant = TenantId::from_caller(context.caller);
        let used = MemoUse::default();
        let remembering = Remembering {
            memo: &self.scan_memo,
            body,
            scope: tenant.0,
            used: &used,
        };
        let scan = match dialect.scan_remembering(&remembering, self.engine.estimator()) {
            Ok(scan) => scan.with_model_from_prefix(&context.caller.api_prefix),
            Err(DialectError::ServerState) => {
                self.metrics.server_state_passthrough();
                return Processed::default();
            }
            Err(e) => {
                self.metrics.unreadable_passthrough();
                tracing::debug!(error = %e, "chat body not understood; forwarding unchanged");
                return Processed::default();
            }
        };
        self.metrics
            .request_tokens_estimated
            .observe(scan.tokens as f64);

        let session = self
            .session_of(&scan, &tenant, context.session_header)
            .await;
        let latest = LatestRequest {
            tenant,
            dialect,
            body: body.clone(),
            caller: context.caller.clone(),
        };
        if let Err(e) = self
            .store
            .touch_session(tenant, &session, latest, scan.len())
            .await
        {
            tracing::warn!(error = %e, "session store unavailable; continuing without it");
        }

        let cohort = Cohort::of(context.mode, self.mode, self.sample_ratio, &session);
        let checkpoint = if cohort.compacts() {
            self.lookup(tenant, &scan.messages).await
        } else {
            None
        };
        let limits = self
            .limits(
                &context.caller.upstream_base_url,
                scan.model.as_deref(),
                context.long_context,
                scan.requested_output,
            )
            .await;
        let lead = self
            .pace
            .observe(&(tenant, &session), scan.len(), scan.tokens, Instant::now());
        let background_at = limits.watermark(self.background_ratio).map(|w| match lead {
            Some(lead) => w.earlier_by(&limits, lead.tokens, lead.messages),
            None => w,
        });
        let request = Request {
            scan: &scan,
            body,
            caller: context.caller,
            tenant,
            session: &session,
            limits,
            background_at,
            slow_summaries: lead.is_some(),
            attempts: context.attempts,
            pays: cohort.compacts()
                && self
                    .payback
                    .as_ref()
                    .is_some_and(|p| p.due(&(tenant, &session))),
        };
        let mut figures = Figures::default();
        let outcome = if !cohort.compacts() {
            Outcome::Unchanged
        } else if checkpoint.is_some()
            || self.strategy.masks()
            || request.pays
            || self.may_compact(&request)
        {
            self.rewrite_path(&request, checkpoint, &mut figures).await
        } else {
            Outcome::Unchanged
        };
        let mut processed = Processed {
            outcome,
            session_id: None,
            tenant,
            summarizer_time: figures.summarizer_time,
            estimate: None,
            cohort,
        };
        self.record_tokens(&request, context.long_context, &used, &mut processed);
        let would_forward = match cohort {
            Cohort::Shadow => self.shadow_forwarded(dialect, body, context).await,
            _ => None,
        };
        let forwarded = processed
            .estimate
            .as_ref()
            .map_or(scan.tokens, |e| e.tokens);
        self.metrics.cohort_request(
            cohort,
            scan.tokens,
            would_forward.unwrap_or(forwarded),
            self.conversations.first(&(tenant, &session)),
        );
        if let Some(masked) = figures.masked_tokens {
            self.metrics.masked_request_tokens(scan.dialect(), masked);
        }
        let masked_outputs = match &processed.outcome {
            Outcome::Masked { masked, .. } => *masked,
            Outcome::Rewritten { .. } | Outcome::Reused { .. } => figures.masked_outputs,
            Outcome::Unchanged | Outcome::Failed => 0,
        };
        if masked_outputs > 0 {
            self.metrics
                .masked_outputs(scan.dialect(), self.strategy, masked_outputs);
        }
        if let (Some(events), true) = (&self.events, cohort.compacts() && self.strategy.masks()) {
            events.masked(&session, masked_outputs, scan.tokens, forwarded);
        }
        let summary = match &processed.outcome {
            Outcome::Rewritten { result, .. } | Outcome::Reused { result, .. } => Some(result),
            Outcome::Masked { .. } | Outcome::Unchanged | Outcome::Failed => None,
        };
        let shape = Shape {
            summary: summary.map_or(0, |r| r.compaction_num),
            masked: masked_outputs,
        };
        if cohort.compacts() {
            let summary = summary.map(|r| r.summary.as_str());
            self.pay_rent(&request, shape, summary, processed.estimate.as_ref());
        }
        let done = match &processed.outcome {
            Outcome::Rewritten { .. } => Done::Compacted,
            Outcome::Reused { .. } => Done::Reused,
            Outcome::Masked { .. } => Done::Masked,
            Outcome::Unchanged => Done::Unchanged,
            Outcome::Failed => Done::Failed,
        };
        self.history.record(
            &session,
            Point::now(
                scan.tokens,
                forwarded,
                request.limits.token_threshold,
                done,
                shape.summary,
            ),
        );
        processed.session_id = Some(session);
        processed
    }

    /// Whether a request with no checkpoint is over the trigger or the background watermark
    /// (the cheap test that keeps most requests off the rewrite path).
    pub(super) fn may_compact(&self, request: &Request<'_, '_>) -> bool {
        let limits = request.background_at.unwrap_or(request.limits);
        let scan = request.scan;
        limits
            .check(scan.counted(0..scan.len()), scan.tokens)
            .is_some()
    }

    /// A body the scan read but whose messages the dialect does not understand: forwarded
    /// unchanged, counted as a failure when a compaction was due.
    pub(super) fn not_understood(&self, due: Option<Trigger>, e: &DialectError) -> Outcome {
        let Some(trigger) = due else {
            tracing::debug!(error = %e, "chat body not parseable; forwarding unchanged");
            return Outcome::Unchanged;
        };
        self.record(trigger, CompactionOutcome::Failed);
        tracing::warn!(error = %e, "compaction due but the body is not understood; forwarding unchanged");
        Outcome::Failed
    }

    /// The session id of a scanned request: the header when sent, else derived from its
    /// opening messages. Two conversations that open alike (the same task started twice)
    /// cannot be told apart until the model's first reply, where they part: the first to
    /// reply keeps the opening's id (so every request of a conversation has one id, its first
    /// included), and another is named by its messages through its own first reply
    /// ([`SessionStore::claim_opening`]). From there on they never share a breaker, a latest
    /// request, summaries made ahead or an admin entry. A store that cannot answer leaves the
    /// opening's id (as before conversations were told apart).
    pub(super) async fn session_of(
        &self,
        scan: &Scan<'_>,
        tenant: &TenantId,
        header: Option<&str>,
    ) -> String {
        if header.is_some_and(|h| !h.trim().is_empty()) {
            return session_id(tenant, header, &[]);
        }
        let messages = &scan.messages;
        let opening = SESSION_ID_MESSAGES.min(messages.len());
        let through_reply = first_reply(scan.dialect(), messages).map_or(0, |i| i + 1);
        let (opening, then) = messages.split_at(opening);
        let then = &then[..through_reply.saturating_sub(opening.len()).min(then.len())];
        let print = self
            .session_ids
            .print(&messages[..opening.len() + then.len()]);
        if let Some(id) = self.session_ids.get(tenant, print) {
            return id;
        }
        let (id, own) = derived_session_ids(tenant, opening, then);
        let settled = if then.is_empty() {
            id
        } else {
            match self.store.claim_opening(*tenant, &id, &own).await {
                Ok(owner) if owner == own => id,
                Ok(_) => own,
                Err(e) => {
                    // Not remembered: the store may settle it otherwise once it answers.
                    tracing::warn!(error = %e, "session store unavailable; naming the session by its opening");
                    return id;
                }
            }
        };
        self.session_ids.insert(tenant, print, settled.clone());
        settled
    }
}
