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

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::config::Strategy;
    use crate::dialect::DialectKind;
    use crate::pipeline::Outcome;
    use crate::testing::{caller, compactor, config, messages_of, FakeSummarizer};

    /// A task, then `steps` tool exchanges whose outputs are `size` characters of numbered
    /// lines.
    fn agent(steps: usize, size: usize) -> Vec<Value> {
        let mut m = vec![
            json!({"role": "system", "content": "You are a coding agent."}),
            json!({"role": "user", "content": "Fix the failing test."}),
        ];
        for i in 0..steps {
            let id = format!("call_{i}");
            m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
                "type": "function", "function": {"name": "bash", "arguments": format!("{{\"cmd\":\"cat f{i}\"}}")}}]}));
            let mut out = format!("output {i} begins\n");
            while out.len() < size {
                out.push_str(&format!("line {} of output {i}\n", out.len()));
            }
            out.push_str(&format!("output {i} ends"));
            m.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
        }
        m
    }

    fn request(messages: &[Value]) -> Vec<u8> {
        json!({"model": "gpt-4o", "messages": messages})
            .to_string()
            .into_bytes()
    }

    fn strategy(name: &str, extra: &str) -> crate::config::Config {
        config(&format!(
            "[compaction]\nstrategy = \"{name}\"\nkeep_recent_outputs = 3\nmask_block = 4\n\
             background_ratio = 0\n{extra}"
        ))
    }

    #[tokio::test]
    async fn mask_replaces_old_outputs_by_placeholders_and_never_summarises() {
        let fake = FakeSummarizer::text("never");
        // Far over every trigger: `mask` still never calls the summarizer.
        let (c, metrics) = compactor(&strategy("mask", "max_messages = 4\n"), fake.clone());
        let messages = agent(12, 600);
        let body = request(&messages);
        let Outcome::Masked {
            body: out,
            pre_tokens,
            post_tokens,
            masked,
        } = c
            .process(DialectKind::ChatCompletions, &body, &caller())
            .await
        else {
            panic!("not masked");
        };
        // 12 outputs, 3 kept: 9 are old, masked in blocks of 4.
        assert_eq!(masked, 8);
        assert!(
            post_tokens < pre_tokens / 2,
            "{post_tokens} of {pre_tokens}"
        );
        let sent = messages_of(&out);
        assert_eq!(sent.len(), messages.len());
        for (i, (got, original)) in sent.iter().zip(&messages).enumerate() {
            let output = (i >= 3 && i % 2 == 1).then(|| (i - 3) / 2);
            match output {
                Some(n) if n < 8 => {
                    let text = got["content"].as_str().expect("a string");
                    assert_eq!(
                        text,
                        format!(
                            "[output masked by compactor: bash call call_{n}, {} chars in {} \
                             lines]\nfirst: output {n} begins\nlast: output {n} ends",
                            original["content"]
                                .as_str()
                                .map_or(0, |t| t.chars().count()),
                            original["content"]
                                .as_str()
                                .map_or(0, |t| t.lines().count()),
                        )
                    );
                    assert_eq!(got["tool_call_id"], original["tool_call_id"]);
                }
                _ => assert_eq!(got, original, "message {i} is forwarded as sent"),
            }
        }
        assert!(fake.requests().is_empty());
        assert_eq!(
            metrics.masked_outputs_counted(DialectKind::ChatCompletions, Strategy::Mask),
            8
        );
    }

    #[tokio::test]
    async fn outputs_shorter_than_their_placeholder_stay_and_summarize_masks_nothing() {
        let (c, metrics) = compactor(&strategy("mask", ""), FakeSummarizer::text("s"));
        let body = request(&agent(12, 20));
        assert!(matches!(
            c.process(DialectKind::ChatCompletions, &body, &caller())
                .await,
            Outcome::Unchanged
        ));
        let (c, _) = compactor(&strategy("summarize", ""), FakeSummarizer::text("s"));
        let body = request(&agent(12, 600));
        assert!(matches!(
            c.process(DialectKind::ChatCompletions, &body, &caller())
                .await,
            Outcome::Unchanged
        ));
        assert_eq!(
            metrics.masked_outputs_counted(DialectKind::ChatCompletions, Strategy::Mask),
            0
        );
    }

    #[tokio::test]
    async fn hybrid_summarises_only_when_the_masked_request_is_still_over_the_trigger() {
        // Outputs of ~600 characters (~250 tokens each): 12 of them are ~3,000 tokens, masked
        // ~1,000; a 2,000-token window triggers at 1,700.
        let limits = "min_preserve_tokens = 50\nmax_preserve_tokens = 400\n\
                      [models.\"gpt-4o\"]\ncontext_window = 2000\n";
        let fake = FakeSummarizer::text("Summary of the work so far.");
        let (c, _) = compactor(&strategy("hybrid", limits), fake.clone());
        let outcome = c
            .process(
                DialectKind::ChatCompletions,
                &request(&agent(12, 600)),
                &caller(),
            )
            .await;
        assert!(matches!(outcome, Outcome::Masked { .. }), "{outcome:?}");
        assert!(fake.requests().is_empty(), "masking was enough");
        // The same request under `summarize` is over the trigger.
        let (s, _) = compactor(&strategy("summarize", limits), FakeSummarizer::text("S."));
        let outcome = s
            .process(
                DialectKind::ChatCompletions,
                &request(&agent(12, 600)),
                &caller(),
            )
            .await;
        assert!(matches!(outcome, Outcome::Rewritten { .. }), "{outcome:?}");
        // Longer, the masked request is over too: one summary, and its tail is masked by the
        // same rule, counted from the first message after the summary.
        let outcome = c
            .process(
                DialectKind::ChatCompletions,
                &request(&agent(40, 600)),
                &caller(),
            )
            .await;
        let Outcome::Rewritten { body, result, .. } = outcome else {
            panic!("not compacted: {outcome:?}");
        };
        assert_eq!(fake.requests().len(), 1);
        let sent = messages_of(&body);
        let tail_outputs = sent.iter().filter(|m| m["role"] == "tool").count();
        let masked = sent
            .iter()
            .filter(|m| {
                m["content"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("[output masked by compactor: "))
            })
            .count();
        assert_eq!(masked, tail_outputs.saturating_sub(3) / 4 * 4, "{sent:?}");
        let scanned = DialectKind::ChatCompletions
            .scan(&body, &crate::estimate::LazyEstimator::default())
            .expect("scan");
        assert!(scanned.tokens.abs_diff(result.post_tokens) <= 2 * masked + 2);
    }

    #[tokio::test]
    async fn outputs_that_cannot_be_read_are_forwarded_as_sent_and_counted() {
        let (c, metrics) = compactor(&strategy("mask", ""), FakeSummarizer::text("s"));
        let mut messages = agent(12, 600);
        // A tool message repeating `content`: which one a provider reads is not compactor's
        // guess, so masking gives up and the request goes out as received.
        let raw = request(&messages);
        let text = String::from_utf8(raw).expect("utf-8");
        let broken = text.replacen(
            "\"tool_call_id\":\"call_0\"",
            "\"tool_call_id\":\"call_0\",\"content\":\"dup\"",
            1,
        );
        assert_ne!(broken, text);
        let outcome = c
            .process(DialectKind::ChatCompletions, broken.as_bytes(), &caller())
            .await;
        assert!(matches!(outcome, Outcome::Unchanged), "{outcome:?}");
        assert!(metrics
            .render()
            .contains("compactor_mask_failures_total{dialect=\"chat_completions\"} 1"));
        messages.truncate(2);
        let outcome = c
            .process(DialectKind::ChatCompletions, &request(&messages), &caller())
            .await;
        assert!(matches!(outcome, Outcome::Unchanged));
    }
}
