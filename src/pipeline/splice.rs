//! Checkpoints and splicing: finding the stored summary that stands in for a prefix of a
//! request, the request with it spliced in (and its size), promoting a summary made ahead, and
//! storing a new checkpoint unless the conversation was edited meanwhile.

use super::*;

impl Pipeline {
    /// The longest checkpoint the request's history matches, counted as a hit or a miss.
    pub(super) async fn lookup(&self, tenant: TenantId, raw: &[&str]) -> Option<Arc<Checkpoint>> {
        let found = self.find_checkpoint(tenant, raw).await;
        self.metrics.checkpoint_lookup(found.is_some());
        found
    }

    /// The longest checkpoint the request's history matches, hashing only as far as the
    /// tenant's checkpoints reach (most requests of a new tenant hash nothing).
    ///
    /// Only prefixes that leave at least one message after them are considered: a checkpoint
    /// covering the whole request cannot be spliced (a tail must remain), and taking it for a
    /// match would make a request that needs compaction look already served.
    pub(super) async fn find_checkpoint(
        &self,
        tenant: TenantId,
        raw: &[&str],
    ) -> Option<Arc<Checkpoint>> {
        let reach = self.store.max_covered(tenant).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "checkpoint lookup failed; treating as a miss");
            0
        });
        let hashed = reach.min(raw.len().saturating_sub(1));
        if hashed == 0 {
            return None;
        }
        match self.memo.chain(&tenant, &raw[..hashed]) {
            Ok(hashes) => self
                .store
                .longest_checkpoint(tenant, &hashes)
                .await
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "checkpoint lookup failed; treating as a miss");
                    None
                }),
            Err(e) => {
                tracing::debug!(error = %e, "messages not canonicalisable; no checkpoint");
                None
            }
        }
    }

    /// Validates a checkpoint against the request and renders its summary message; `None`
    /// when it cannot stand in for a prefix of this request.
    pub(super) fn splice(
        &self,
        scan: &Scan<'_>,
        checkpoint: Arc<Checkpoint>,
    ) -> Result<Option<Splice>, DialectError> {
        // The head the summary was made after (the covered prefix is the one it was made
        // from, so that head is this request's too); one stored before openings were kept
        // follows the head without the opening.
        let head = match checkpoint.head {
            Some(head) => head,
            None => scan.head_len(0)?,
        };
        let covered = checkpoint.covered;
        // The summary replaces whole turns after the system head, and a tail must remain.
        if covered <= head || covered >= scan.len() {
            return Ok(None);
        }
        Ok(Some(Splice {
            head,
            covered,
            message: summary_message(
                &checkpoint.result.summary,
                &checkpoint.result.read_files,
                &checkpoint.result.modified_files,
            ),
            checkpoint,
        }))
    }

    /// Messages and estimated tokens the upstream receives after the splice and `mask`.
    pub(super) fn view_size(
        &self,
        scan: &Scan<'_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
    ) -> (usize, usize) {
        let (count, tokens) = self.spliced_size(scan, splice);
        (count, tokens.saturating_sub(mask.saved))
    }

    /// The body the upstream receives after the splice and `mask` (the request's own bytes
    /// with neither); `None` when it cannot be written (the request then goes as received).
    pub(super) fn forwarded_body<'r>(
        &self,
        request: &Request<'r, '_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
    ) -> Option<Cow<'r, [u8]>> {
        if splice.is_none() && mask.edits.is_empty() {
            return Some(Cow::Borrowed(&request.body[..]));
        }
        let summary = splice.map(|s| (s.head, s.covered, s.message.as_str()));
        request
            .scan
            .rewrite_with(summary, &mask.edits)
            .ok()
            .map(Cow::Owned)
    }

    /// Messages (as the message-count trigger counts them, [`Scan::counted`]) and estimated
    /// tokens the upstream receives after the splice.
    pub(super) fn spliced_size(&self, scan: &Scan<'_>, splice: Option<&Splice>) -> (usize, usize) {
        match splice {
            None => (scan.counted(0..scan.len()), scan.tokens),
            Some(s) => {
                let tokens = scan
                    .fixed_tokens
                    .saturating_add(scan.tokens_of(0..s.head))
                    .saturating_add(self.engine.estimator().text(&s.message))
                    .saturating_add(scan.tokens_of(s.covered..scan.len()));
                let count = scan.counted(0..s.head) + 1 + scan.counted(s.covered..scan.len());
                (count, tokens)
            }
        }
    }

    /// The request with a stored summary spliced in and the outputs of `mask` masked,
    /// unchanged with neither; `forwarded` is its estimate. A rewrite that fails with the
    /// masks is made without them (counted), one that fails without them forwards the
    /// original bytes.
    pub(super) fn reuse(
        &self,
        scan: &Scan<'_>,
        splice: Option<&Splice>,
        mask: &Masking<'_>,
        forwarded: usize,
        figures: &mut Figures,
    ) -> Outcome {
        if !mask.edits.is_empty() {
            let summary = splice.map(|s| (s.head, s.covered, s.message.as_str()));
            match (scan.rewrite_with(summary, &mask.edits), splice) {
                (Ok(body), None) => {
                    return Outcome::Masked {
                        body: Bytes::from(body),
                        pre_tokens: scan.tokens,
                        post_tokens: forwarded,
                        masked: mask.masked(),
                    }
                }
                (Ok(body), Some(s)) => {
                    figures.masked_outputs = mask.masked();
                    return self.reused(scan, s, body, forwarded);
                }
                (Err(e), _) => {
                    self.metrics.mask_failed(scan.dialect());
                    tracing::warn!(error = %e, "masking old outputs failed; forwarding them as sent");
                    let unmasked = forwarded.saturating_add(mask.saved);
                    return self.reuse(scan, splice, &Masking::default(), unmasked, figures);
                }
            }
        }
        let Some(s) = splice else {
            return Outcome::Unchanged;
        };
        match scan.rewrite(s.head, s.covered, &s.message) {
            Ok(body) => self.reused(scan, s, body, forwarded),
            Err(e) => {
                tracing::warn!(error = %e, "splicing a stored summary failed; forwarding unchanged");
                Outcome::Unchanged
            }
        }
    }

    /// A body carrying a stored summary, as [`Outcome::Reused`].
    pub(super) fn reused(
        &self,
        scan: &Scan<'_>,
        s: &Splice,
        body: Vec<u8>,
        forwarded: usize,
    ) -> Outcome {
        Outcome::Reused {
            body: Bytes::from(body),
            result: CompactionResult {
                pre_tokens: scan.tokens,
                post_tokens: forwarded,
                ..s.checkpoint.result.clone()
            },
        }
    }

    /// The stored checkpoint that can stand in for a prefix of `scan`, if any.
    pub(super) async fn stored_splice(&self, request: &Request<'_, '_>) -> Option<Splice> {
        let scan = request.scan;
        let checkpoint = self.lookup(request.tenant, &scan.messages).await?;
        self.splice(scan, checkpoint).ok().flatten()
    }

    /// A staged summary spliced into the request, with the outputs masked after it, and the
    /// messages and estimated tokens the upstream would receive; `None` when it cannot stand in
    /// for a prefix of this request.
    pub(super) async fn staged_view<'b>(
        &self,
        request: &Request<'_, 'b>,
        staged: Arc<Checkpoint>,
    ) -> Result<Option<(Splice, Masking<'b>, usize, usize)>, DialectError> {
        let Some(ready) = self.splice(request.scan, staged)? else {
            return Ok(None);
        };
        let mask = self.mask_view(request, Some(&ready), None).await;
        let (count, tokens) = self.view_size(request.scan, Some(&ready), &mask);
        Ok(Some((ready, mask, count, tokens)))
    }

    /// Whether the session's latest request no longer starts with the first `covered`
    /// messages of `request` (the person edited or rewound the conversation while its summary
    /// was being made): such a summary would never be spliced.
    ///
    /// A latest request shorter than `covered` that `request` extends is not an edit: it is an
    /// earlier request of the conversation (with a shared store, the latest one written may
    /// lag behind the request another replica is answering).
    pub(super) async fn edited_since(&self, request: &Request<'_, '_>, covered: usize) -> bool {
        let latest = match self.store.latest_request(request.session).await {
            Ok(Some(latest)) if latest.tenant == request.tenant => latest,
            _ => return false,
        };
        let Ok(now) = latest.dialect.scan(&latest.body, self.engine.estimator()) else {
            return true;
        };
        let common = covered.min(now.messages.len());
        let (Some(then), Some(now)) = (
            request.scan.messages.get(..common),
            now.messages.get(..common),
        ) else {
            return true;
        };
        let last = |messages: &[&str]| {
            self.memo
                .chain(&request.tenant, messages)
                .ok()
                .and_then(|h| h.last().copied())
        };
        last(then) != last(now)
    }

    /// Stores a staged checkpoint again as one in use, now that a request needed it, so the
    /// conversation's next requests splice it whatever their size.
    pub(super) async fn promote(&self, request: &Request<'_, '_>, splice: &Splice) {
        if splice.checkpoint.staged.is_none() {
            return;
        }
        let Some(prefix) = request.scan.messages.get(..splice.covered) else {
            return;
        };
        let Ok(Some(hash)) = self
            .memo
            .chain(&request.tenant, prefix)
            .map(|h| h.last().copied())
        else {
            return;
        };
        let in_use = Arc::new(Checkpoint {
            staged: None,
            ..(*splice.checkpoint).clone()
        });
        if let Err(e) = self
            .store
            .put_checkpoint(request.tenant, hash, in_use)
            .await
        {
            tracing::warn!(error = %e, "promoting a background summary failed");
        }
    }

    /// Stores the checkpoint of a compaction under the chain hash of the prefix it covers.
    pub(super) async fn store_checkpoint(
        &self,
        request: &Request<'_, '_>,
        compaction: &Compaction,
        staged: Option<Staged>,
    ) -> Option<Arc<Checkpoint>> {
        let prefix = request.scan.messages.get(..compaction.boundary)?;
        let hash = match self
            .memo
            .chain(&request.tenant, prefix)
            .map(|h| h.last().copied())
        {
            Ok(Some(hash)) => hash,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "checkpoint not stored: messages not hashable");
                return None;
            }
        };
        let checkpoint = Arc::new(Checkpoint {
            session_id: request.session.to_string(),
            covered: compaction.boundary,
            head: Some(compaction.head),
            result: compaction.result.clone(),
            created_unix: crate::session::store::unix_now(),
            staged,
        });
        match self
            .store
            .put_checkpoint(request.tenant, hash, checkpoint.clone())
            .await
        {
            Ok(()) => Some(checkpoint),
            Err(e) => {
                tracing::warn!(error = %e, "storing the checkpoint failed; the next request compacts again");
                None
            }
        }
    }
}
