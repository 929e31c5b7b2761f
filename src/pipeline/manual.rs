//! Manual compaction (`POST /session/{id}/summarize`): the conversation's latest request
//! compacted now, with optional focus instructions.

use super::*;

impl Pipeline {
    /// Compacts the latest request of a session now (admin API), with optional focus
    /// instructions, whatever the triggers say. A panic (a bug) is caught and counted like in
    /// [`Pipeline::handle`].
    pub async fn compact_session(&self, id: &str, instructions: Option<&str>) -> ManualOutcome {
        let compacted = AssertUnwindSafe(self.compact_session_unguarded(id, instructions))
            .catch_unwind()
            .await;
        compacted.unwrap_or_else(|_| {
            self.record(Trigger::Manual, CompactionOutcome::Panic);
            tracing::error!(session = id, "manual compaction panicked");
            ManualOutcome::NotCompacted { reason: "panic" }
        })
    }

    pub(super) async fn compact_session_unguarded(
        &self,
        id: &str,
        instructions: Option<&str>,
    ) -> ManualOutcome {
        let latest = match self.store.latest_request(id).await {
            Ok(Some(l)) => l,
            Ok(None) => return ManualOutcome::UnknownSession,
            Err(e) => {
                tracing::warn!(error = %e, "session store unavailable");
                return ManualOutcome::NotCompacted {
                    reason: "store_unavailable",
                };
            }
        };
        // The latest request may come from Redis, written by any replica (or anyone who can
        // write Redis). Its destination is where a summarizer without its own `base_url`
        // sends its configured key and the conversation: only an upstream this replica routes
        // to is trusted with them.
        if !self
            .upstreams
            .iter()
            .any(|u| *u == latest.caller.upstream_base_url)
        {
            tracing::warn!(
                session = id,
                "the session's latest request names an upstream this replica does not route to; not compacted"
            );
            return ManualOutcome::NotCompacted {
                reason: "unknown_upstream",
            };
        }
        let not_understood = ManualOutcome::NotCompacted {
            reason: "request_not_understood",
        };
        let Ok(scan) = latest.dialect.scan(&latest.body, self.engine.estimator()) else {
            return not_understood;
        };
        let scan = scan.with_model_from_prefix(&latest.caller.api_prefix);
        let limits = self
            .limits(
                &latest.caller.upstream_base_url,
                scan.model.as_deref(),
                false,
                scan.requested_output,
            )
            .await;
        let Ok(transcript) = transcript_to_summarise(&scan, limits.opening_budget) else {
            return not_understood;
        };
        let request = Request {
            scan: &scan,
            body: &latest.body,
            caller: &latest.caller,
            tenant: latest.tenant,
            session: id,
            limits,
            background_at: None,
            slow_summaries: false,
            attempts: &Attempts::per_request(),
            pays: false,
        };
        if !self.breaker_allows(latest.tenant, id).await {
            self.record(Trigger::Manual, CompactionOutcome::Breaker);
            return ManualOutcome::NotCompacted {
                reason: "breaker_open",
            };
        }
        let started = Instant::now();
        let compacted = self
            .compact_now(&request, &transcript, instructions, started)
            .await;
        let succeeded = matches!(&compacted, Ok(c) if !c.still_over(&request.limits));
        self.feed_breaker(latest.tenant, id, succeeded).await;
        match compacted {
            Ok(Compacted {
                compaction,
                stored: Some(checkpoint),
                ..
            }) => {
                self.record(Trigger::Manual, CompactionOutcome::Compacted);
                self.log_compaction(id, Trigger::Manual, scan.len(), &compaction, started);
                ManualOutcome::Compacted(checkpoint)
            }
            // Made but not stored: nothing of it reaches the session, so the answer and the
            // metric both say so.
            Ok(Compacted { stored: None, .. }) => {
                self.record(Trigger::Manual, CompactionOutcome::NotStored);
                tracing::warn!(
                    session = id,
                    "manual compaction summarised but its checkpoint was not stored"
                );
                ManualOutcome::NotCompacted {
                    reason: "checkpoint_not_stored",
                }
            }
            Err(e) => {
                let outcome = e.outcome();
                self.record(Trigger::Manual, outcome);
                tracing::warn!(session = id, error = %e, "manual compaction did not happen");
                ManualOutcome::NotCompacted {
                    reason: match e {
                        Failure::Engine(CompactError::NothingToCompact) => "nothing_to_compact",
                        Failure::Engine(CompactError::Summarizer(SummarizeError::Blank)) => {
                            "blank_summary"
                        }
                        Failure::Engine(CompactError::Summarizer(_) | CompactError::Timeout(_)) => {
                            "summarizer_failed"
                        }
                        Failure::Engine(CompactError::NotSmaller { .. }) => "not_smaller",
                        Failure::Engine(CompactError::Prompt(_)) => "prompt_too_large",
                        Failure::Engine(CompactError::NoAttemptsLeft) => "summarizer_failed",
                        Failure::Dialect(_) => "rewrite_failed",
                    },
                }
            }
        }
    }
}
