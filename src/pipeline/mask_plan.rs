//! How many old tool outputs a request masks (`mask`, `hybrid`): the step rule over the
//! trigger, the floor an earlier request left, and masking standing in for a summary that
//! cannot be had. `mask_candidates` finds and weighs the candidates.

use super::*;

impl Pipeline {
    /// The masking of the conversation `request` forwards with `splice` (`None`: the whole
    /// request), with the conversation's `staged` summary (made ahead) if it has one; see
    /// [`Pipeline::plan_mask`].
    pub(super) async fn mask_view<'b>(
        &self,
        request: &Request<'_, 'b>,
        splice: Option<&Splice>,
        staged: Option<&Arc<Checkpoint>>,
    ) -> Masking<'b> {
        if !self.strategy.masks() {
            return Masking::default();
        }
        let view = self.spliced_size(request.scan, splice);
        self.plan_mask(request, splice.map(|s| s.covered), view, staged)
            .await
    }

    /// The masking of the conversation `request` forwards after the first `covered` messages
    /// (a summary's; `None`: the whole request), whose messages and estimated tokens are
    /// `view` before masking; empty unless the strategy masks. `mask` masks every output the
    /// rule allows. `hybrid` masks nothing while `view` is under the request's trigger; over
    /// it, one step masks every maskable output (when even that cannot get back under the
    /// background watermark: none if the `staged` summary made ahead fits the request, else
    /// in `mask_block` blocks; with background summaries off, none unless it leaves room for
    /// one more turn), and never masks fewer than an earlier request of the
    /// conversation did (the session's [`MaskFloor`](crate::session::MaskFloor)), so the
    /// masked prefix only grows and every replica forwards the same bytes. A request whose
    /// outputs cannot be read is forwarded with its outputs as sent (counted).
    pub(super) async fn plan_mask<'b>(
        &self,
        request: &Request<'_, 'b>,
        covered: Option<usize>,
        view: (usize, usize),
        staged: Option<&Arc<Checkpoint>>,
    ) -> Masking<'b> {
        if !self.strategy.masks() {
            return Masking::default();
        }
        let scan = request.scan;
        let estimator = self.engine.estimator();
        let start = covered.unwrap_or(0);
        let from = match covered.map_or(Ok(0), |covered| scan.verbatim_from(covered)) {
            Ok(from) => from,
            Err(e) => return self.unreadable(scan, &e),
        };
        let find = || Found::in_scan(scan, &self.masker, start);
        if self.strategy != Strategy::Hybrid {
            return match find().and_then(|f| f.weigh(scan, from, estimator, usize::MAX)) {
                Ok(candidates) => candidates.all(),
                Err(e) => self.unreadable(scan, &e),
            };
        }
        let (count, tokens) = view;
        let fits = |limits: Limits| {
            move |saved: usize| limits.check(count, tokens.saturating_sub(saved)).is_none()
        };
        let watermark = request.limits.watermark(self.background_ratio);
        let soft = watermark.unwrap_or(request.limits);
        if fits(soft)(0) {
            // Under the watermark as sent: no step is due and no summary is made ahead, so only
            // the floor an earlier request left is masked, and only its outputs are read
            // (reading and weighing every output of every request doubled a tool-heavy
            // request's cost). A request that cannot hold an output old enough to mask
            // (counted by a substring search) does not ask the store.
            let bound = (start..scan.len())
                .map(|i| scan.outputs_bound(i, self.masker.observations.is_some()))
                .fold(0, usize::saturating_add);
            if self.masker.rule.masked(bound) == 0 {
                return Masking::default();
            }
            let floor = self
                .mask_floor(request, start, MaskNeed { enough: 0, step: 0 })
                .await;
            if floor == 0 {
                return Masking::default();
            }
            return match find().and_then(|f| f.weigh(scan, from, estimator, floor)) {
                Ok(candidates) => candidates.first(floor),
                Err(e) => self.unreadable(scan, &e),
            };
        }
        let found = match find() {
            Ok(found) if found.is_empty() => return Masking::default(),
            Ok(found) => found,
            Err(e) => return self.unreadable(scan, &e),
        };
        let candidates = match found.weigh(scan, from, estimator, usize::MAX) {
            Ok(candidates) => candidates,
            Err(e) => return self.unreadable(scan, &e),
        };
        // A step masks every maskable output (all but the `keep_recent_outputs` most recent),
        // as Anthropic's context editing clears all but the most recent tool results: that
        // buys the most headroom, so the next step (a break in the provider's prompt cache) is
        // as far away as it can be, and the request is smallest. Masking only down to the
        // watermark broke the prefix more often for more tokens forwarded, with the same
        // summarizer calls (README's long-session replay).
        //
        // When masking every maskable output cannot get back under the background watermark,
        // a step buys a request or two: the next one is over its trigger again and masks one
        // output more, a break of the prefix each time. So a summary made ahead, when one is
        // ready and fits this request, stands in (no step: the request goes over its trigger
        // and splices it, far under); one that does not fit (an edited conversation) would
        // mean a summary on the request path. Without one, masking moves in whole blocks of
        // `mask_block` (as `mask` does) if that is enough for the trigger; else every maskable
        // output, if that is enough (a summary would change the prefix too, and costs a call,
        // on the request path); and not at all otherwise (the request is summarised).
        //
        // Without background summaries there is no watermark and no summary made ahead: a
        // step must leave room under the trigger for the next request, about one more turn
        // like the last (its call and output), or the next request is over again and masks
        // one output more, a break of the prefix on every request until the conversation is
        // summarised anyway. Such a request is summarised now instead.
        let enough = candidates.needed(fits(request.limits));
        let all = candidates.len();
        let target = watermark.unwrap_or_else(|| {
            let turn = scan.len().saturating_sub(TURN)..scan.len();
            request.limits.less(turn.len(), scan.tokens_of(turn))
        });
        let step = if enough == 0 {
            0
        } else if fits(target)(candidates.saving(all)) {
            all
        } else if watermark.is_none()
            || staged.is_some_and(|c| matches!(self.splice(scan, c.clone()), Ok(Some(_))))
        {
            0
        } else {
            let block = self.masker.block.max(1);
            let blocks = all / block * block;
            if blocks < enough && fits(request.limits)(candidates.saving(all)) {
                all
            } else {
                blocks
            }
        };
        let masked = self
            .mask_floor(request, start, MaskNeed { enough, step })
            .await;
        candidates.first(masked)
    }

    /// The request over its trigger forwarded with no new summary: any stored one spliced in,
    /// its outputs masked as [`Pipeline::mask_instead`] says.
    pub(super) async fn without_summary(
        &self,
        request: &Request<'_, '_>,
        splice: Option<&Splice>,
        mask: Masking<'_>,
        figures: &mut Figures,
    ) -> Outcome {
        let mask = self.mask_instead(request, splice, mask).await;
        let (_, tokens) = self.view_size(request.scan, splice, &mask);
        self.reuse(request.scan, splice, &mask, tokens, figures)
    }

    /// `hybrid` over its trigger with no new summary to be had (the conversation's breaker is
    /// open, or the summary failed): masking every maskable output stands in for it, so the
    /// request is as small as masking can make it, and the mask floor keeps the step for the
    /// requests after it. Other strategies, and a `mask` that already masks as much, are left
    /// as they are.
    pub(super) async fn mask_instead<'b>(
        &self,
        request: &Request<'_, 'b>,
        splice: Option<&Splice>,
        mask: Masking<'b>,
    ) -> Masking<'b> {
        if self.strategy != Strategy::Hybrid {
            return mask;
        }
        let scan = request.scan;
        let start = splice.map_or(0, |s| s.covered);
        let from = match splice.map_or(Ok(0), |s| scan.verbatim_from(s.covered)) {
            Ok(from) => from,
            Err(_) => return mask,
        };
        let candidates = Found::in_scan(scan, &self.masker, start)
            .and_then(|f| f.weigh(scan, from, self.engine.estimator(), usize::MAX));
        let candidates = match candidates {
            Ok(c) if c.len() > mask.masked() => c,
            _ => return mask,
        };
        let all = candidates.len();
        let need = MaskNeed {
            enough: all,
            step: all,
        };
        let masked = self.mask_floor(request, start, need).await;
        candidates.first(masked)
    }

    /// How many outputs `request` masks, from the conversation's stored mask floor and what
    /// it `need`s (see [`MaskFloor::raise`]).
    pub(super) async fn mask_floor(
        &self,
        request: &Request<'_, '_>,
        covered: usize,
        need: MaskNeed,
    ) -> usize {
        self.store
            .raise_mask_floor(request.tenant, request.session, covered, need)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "mask floor unavailable; masking as if it were the first step");
                MaskFloor::raise(None, covered, need).1
            })
    }

    /// Old outputs that cannot be read: forwarded as sent, counted.
    pub(super) fn unreadable<'b>(&self, scan: &Scan<'_>, e: &DialectError) -> Masking<'b> {
        self.metrics.mask_failed(scan.dialect());
        tracing::warn!(error = %e, "old outputs not readable; forwarding them as sent");
        Masking::default()
    }
}
