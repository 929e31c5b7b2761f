//! Masking old observations in the forwarded request (`compaction.strategy` `mask` and
//! `hybrid`; docs/architecture.md, *Masking of old observations*): the tool outputs of the
//! conversation a request forwards, which of them the [`MaskRule`] masks, the placeholder of
//! each, and the estimated tokens that saves.
//!
//! The plan is a pure function of the request, the stored checkpoint spliced into it (the
//! forwarded conversation starts after the messages its summary covers) and the rule, so every
//! replica and every later request of the conversation computes the same bytes without
//! storing anything: the checkpoint that defines the summary also defines where counting
//! starts.

use crate::compaction::mask::{placeholder, MaskRule};
use crate::dialect::outputs::{output_text, Edit};
use crate::dialect::{DialectError, Scan};
use crate::estimate::{text_weight, Counts, LazyEstimator};

/// The outputs a forwarded request masks.
#[derive(Debug, Default)]
pub(super) struct Masking<'a> {
    /// One per output replaced by its placeholder.
    pub edits: Vec<Edit<'a>>,
    /// Estimated tokens the placeholders save over the outputs they replace.
    pub saved: usize,
}

impl Masking<'_> {
    /// Outputs replaced.
    pub fn masked(&self) -> usize {
        self.edits.len()
    }
}

/// The masking of the conversation `scan` forwards from message `start` on (after the system
/// head, or after the messages a stored summary covers): the first outputs the rule masks,
/// except those in messages before `maskable_from` (a message the summary is merged into is
/// rewritten whole) and those whose placeholder would be no shorter than the output as sent.
pub(super) fn plan<'a>(
    scan: &Scan<'a>,
    rule: MaskRule,
    start: usize,
    maskable_from: usize,
    estimator: &LazyEstimator,
) -> Result<Masking<'a>, DialectError> {
    let mut outputs = Vec::new();
    for i in start..scan.len() {
        outputs.extend(scan.outputs(i)?);
    }
    let mut masking = Masking::default();
    let masked = rule.masked(outputs.len());
    for output in outputs.into_iter().take(masked) {
        let Some(value) = output.value.filter(|_| output.message >= maskable_from) else {
            continue;
        };
        let content = output_text(value)?;
        let name = output.name.clone().or_else(|| {
            output
                .call_id
                .as_deref()
                .and_then(|id| scan.call_name(id, output.message))
        });
        let text = placeholder(
            output.call_id.as_deref(),
            name.as_deref(),
            &content.text,
            content.images,
        );
        if serde_json::to_string(&text)?.len() >= value.len() {
            continue; // already shorter than its placeholder
        }
        let before = estimator.counts(Counts {
            text: text_weight(&content.text),
            images: content.images,
        });
        masking.saved = masking
            .saved
            .saturating_add(before.saturating_sub(estimator.text(&text)));
        masking.edits.push(Edit { value, text });
    }
    Ok(masking)
}
