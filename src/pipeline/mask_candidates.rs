//! Masking old observations in the forwarded request (`compaction.strategy` `mask` and
//! `hybrid`; docs/architecture.md, *Masking of old observations*): the tool outputs of the
//! conversation a request forwards, which of them the [`MaskRule`] masks, the placeholder of
//! each, and the estimated tokens that saves.
//!
//! Which outputs may be masked is a pure function of the request, the stored checkpoint
//! spliced into it (the forwarded conversation starts after the messages its summary covers)
//! and the rule: the checkpoint that defines the summary also defines where counting starts.
//! How many of them `hybrid` masks is the pipeline's decision (`Pipeline::plan_mask`), from
//! the trigger and the conversation's mask floor in the session store.

use crate::compaction::mask_rule::{placeholder, MaskRule};
use regex::Regex;

use crate::dialect::outputs::{output_text, CallNames, Edit, WireOutput};
use crate::dialect::{DialectError, Scan};
use crate::estimate::{text_weight, Counts, LazyEstimator};

/// What a placeholder calls an observation sent as a user turn, where a tool output names its
/// tool.
const OBSERVATION: &str = "observation";

/// The outputs a forwarded request masks.
#[derive(Debug, Default)]
pub(super) struct Masking<'a> {
    /// One per output replaced by its placeholder.
    pub edits: Vec<Edit<'a>>,
    /// Estimated tokens the placeholders save over the outputs they replace.
    pub saved: usize,
    /// Estimated tokens that masking every output the rule allows would save beyond `saved`
    /// (`hybrid` masks only as many as the trigger needs).
    pub spare: usize,
}

impl Masking<'_> {
    /// Outputs replaced.
    pub fn masked(&self) -> usize {
        self.edits.len()
    }
}

/// The outputs the rule lets a request mask, oldest first, each with what masking it saves.
#[derive(Debug, Default)]
pub(super) struct Candidates<'a> {
    /// One per output the rule may mask; `None` for one that stays as sent (inside a message
    /// a summary is merged into, or no longer than its placeholder).
    outputs: Vec<Option<(Edit<'a>, usize)>>,
}

impl<'a> Candidates<'a> {
    /// Outputs that may be masked.
    pub fn len(&self) -> usize {
        self.outputs.len()
    }

    /// Every output the rule allows masked (`mask`).
    pub fn all(self) -> Masking<'a> {
        let k = self.outputs.len();
        self.first(k)
    }

    /// How many of the oldest outputs must be masked for the request to `fit` (given the
    /// tokens masking saves): the fewest that do, or every one when none do.
    pub fn needed(&self, fits: impl Fn(usize) -> bool) -> usize {
        let mut saved = 0usize;
        let mut k = 0;
        while k < self.outputs.len() && !fits(saved) {
            if let Some((_, s)) = &self.outputs[k] {
                saved = saved.saturating_add(*s);
            }
            k += 1;
        }
        k
    }

    /// Estimated tokens masking the first `k` outputs saves.
    pub fn saving(&self, k: usize) -> usize {
        self.outputs
            .iter()
            .take(k)
            .flatten()
            .fold(0, |sum, (_, s)| sum.saturating_add(*s))
    }

    /// The first `k` outputs masked (all of them when there are fewer).
    pub fn first(self, k: usize) -> Masking<'a> {
        let mut masking = Masking::default();
        for (i, (edit, saved)) in self
            .outputs
            .into_iter()
            .enumerate()
            .filter_map(|(i, o)| Some((i, o?)))
        {
            if i < k {
                masking.saved = masking.saved.saturating_add(saved);
                masking.edits.push(edit);
            } else {
                masking.spare = masking.spare.saturating_add(saved);
            }
        }
        masking
    }
}

/// Which outputs a forwarded request masks: the rule, and what tells an observation sent as
/// a person's turn (`compaction.observation_pattern`).
#[derive(Debug, Clone)]
pub(super) struct Masker {
    /// Which outputs may be masked.
    pub rule: MaskRule,
    /// `compaction.mask_block`.
    pub block: usize,
    /// Matched against the text of each user turn that follows an assistant turn; `None`:
    /// only tool outputs count.
    pub observations: Option<Regex>,
}

/// The outputs of the conversation `scan` forwards from message `start` on (after the system
/// head, or after the messages a stored summary covers) that the rule lets a request mask,
/// oldest first, not yet weighed.
pub(super) struct Found<'a>(Vec<WireOutput<'a>>);

impl<'a> Found<'a> {
    /// Finds them: a substring test skips messages that cannot hold an output, and a
    /// structural pass reads the others.
    pub fn in_scan(scan: &Scan<'a>, masker: &Masker, start: usize) -> Result<Self, DialectError> {
        let mut outputs = Vec::new();
        for i in start..scan.len() {
            let found = scan.outputs(i)?;
            if found.is_empty() {
                if let Some(pattern) = &masker.observations {
                    if let Some(turn) = scan.observation(i)? {
                        let said = turn.value.map(output_text).transpose()?;
                        if said.is_some_and(|t| pattern.is_match(&t.text)) {
                            outputs.push(WireOutput {
                                name: Some(OBSERVATION.to_string()),
                                ..turn
                            });
                        }
                    }
                }
            }
            outputs.extend(found);
        }
        let masked = masker.rule.masked(outputs.len());
        outputs.truncate(masked);
        Ok(Found(outputs))
    }

    /// Whether the rule lets no output be masked.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The placeholders of the first `limit` of them and what each saves (the rest are not
    /// weighed: [`Candidates`] then knows only those); those in messages before
    /// `maskable_from` (a message the summary is merged into is rewritten whole) and those
    /// whose placeholder would be no shorter than the output as sent stay as sent.
    pub fn weigh(
        self,
        scan: &Scan<'a>,
        maskable_from: usize,
        estimator: &LazyEstimator,
        limit: usize,
    ) -> Result<Candidates<'a>, DialectError> {
        let mut candidates = Candidates::default();
        let mut names = CallNames::new(scan, &self.0);
        for output in self.0.into_iter().take(limit) {
            let Some(value) = output.value.filter(|_| output.message >= maskable_from) else {
                candidates.outputs.push(None);
                continue;
            };
            let content = output_text(value)?;
            let name = output.name.clone().or_else(|| {
                output
                    .call_id
                    .as_deref()
                    .and_then(|id| names.name(id, output.message))
            });
            let text = placeholder(
                output.call_id.as_deref(),
                name.as_deref(),
                &content.text,
                content.images,
            );
            if serde_json::to_string(&text)?.len() >= value.len() {
                candidates.outputs.push(None); // already shorter than its placeholder
                continue;
            }
            let before = estimator.counts(Counts {
                text: text_weight(&content.text),
                images: content.images,
            });
            let after = estimator.text(&text);
            if after >= before {
                // Fewer bytes but no fewer tokens (dense text: the placeholder's words weigh
                // more): masking it saves nothing, and counting it as saving 0 would make the
                // forwarded estimate lower than the request's.
                candidates.outputs.push(None);
                continue;
            }
            candidates
                .outputs
                .push(Some((Edit { value, text }, before - after)));
        }
        Ok(candidates)
    }
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
    async fn an_output_its_placeholder_would_not_make_cheaper_in_tokens_stays() {
        // Fewer bytes as a placeholder (its tabs are escaped in JSON), but more tokens: tabs
        // weigh less than the placeholder's words and digits.
        let mut messages = agent(12, 600);
        let tabs = format!("x\n{}\ny", "\t".repeat(100));
        messages[3]["content"] = Value::String(tabs);
        let (c, _) = compactor(
            &strategy("mask", "max_messages = 4\n"),
            FakeSummarizer::text("s"),
        );
        let body = request(&messages);
        let Outcome::Masked { body: out, .. } = c
            .process(DialectKind::ChatCompletions, &body, &caller())
            .await
        else {
            panic!("not masked");
        };
        let sent = messages_of(&out);
        assert_eq!(sent[3], messages[3], "forwarded as sent");
        assert!(
            sent[5]["content"]
                .as_str()
                .is_some_and(|t| t.starts_with("[output masked by compactor")),
            "the next old output is masked"
        );
    }

    /// The forwarded outcome of `agent(12, 600)` (about 2,900 tokens, about 200 per output;
    /// 9 old outputs: `mask` masks 8 in blocks of 4, `hybrid` may mask any of the 9) under
    /// `name` with a `window`-token context window, with background summaries at 0.7 of the
    /// trigger or none, and the summarizer calls made once background summaries have settled.
    async fn twelve_outputs(name: &str, window: usize, background: bool) -> (Outcome, usize) {
        let mut config = strategy(
            name,
            &format!("[models.\"gpt-4o\"]\ncontext_window = {window}\n"),
        );
        if background {
            config.compaction.background_ratio = 0.7;
        }
        let fake = FakeSummarizer::text("Summary of the work so far.");
        let (c, _) = compactor(&config, fake.clone());
        let body = request(&agent(12, 600));
        let outcome = c
            .process(DialectKind::ChatCompletions, &body, &caller())
            .await;
        c.background_idle().await;
        (outcome, fake.requests().len())
    }

    fn masked(outcome: &Outcome) -> usize {
        masked_to(outcome).0
    }

    /// Outputs masked and estimated tokens forwarded of a masked outcome.
    fn masked_to(outcome: &Outcome) -> (usize, usize) {
        match outcome {
            Outcome::Masked {
                masked,
                post_tokens,
                ..
            } => (*masked, *post_tokens),
            other => panic!("not masked: {other:?}"),
        }
    }

    #[tokio::test]
    async fn hybrid_masks_nothing_under_the_trigger_and_every_old_output_over_it() {
        // Under the trigger (a 3,500-token window triggers at 2,975): forwarded as sent, and
        // no summary is made ahead although the request is over the watermark (2,082): masked
        // whole it would be under it.
        let (outcome, calls) = twelve_outputs("hybrid", 3_500, true).await;
        assert!(matches!(outcome, Outcome::Unchanged), "{outcome:?}");
        assert_eq!(calls, 0);
        // Over it (2,500: trigger 2,125, watermark 1,487), one step masks every old output,
        // not just enough for the watermark or the trigger, so the next step is as far away
        // as it can be.
        for background in [true, false] {
            let (outcome, calls) = twelve_outputs("hybrid", 2_500, background).await;
            let (masked, post_tokens) = masked_to(&outcome);
            assert_eq!(masked, 9);
            assert!(post_tokens < 1_487, "{post_tokens}");
            assert_eq!(calls, 0);
        }
        // `mask` masks every old output it may, in blocks, whatever the trigger.
        let (outcome, _) = twelve_outputs("mask", 20_000, false).await;
        assert_eq!(masked(&outcome), 8);
    }

    #[tokio::test]
    async fn hybrid_never_unmasks_what_an_earlier_request_of_the_conversation_masked() {
        // `mid`'s window puts the conversation between its watermark (2,380) and its trigger
        // (3,400): no step is due there.
        let config = strategy(
            "hybrid",
            "[models.\"gpt-4o\"]\ncontext_window = 2500\n[models.mid]\ncontext_window = 4000\n",
        );
        let messages = agent(12, 600);
        let (c, _) = compactor(&config, FakeSummarizer::text("never"));
        let first = masked(
            &c.process(DialectKind::ChatCompletions, &request(&messages), &caller())
                .await,
        );
        assert_eq!(first, 9);
        // The next request of the conversation goes to `mid`: a compactor that never saw the
        // first forwards it as sent, this one keeps the first's outputs masked.
        let mid = json!({"model": "mid", "messages": messages})
            .to_string()
            .into_bytes();
        let (fresh, _) = compactor(&config, FakeSummarizer::text("never"));
        let alone = fresh
            .process(DialectKind::ChatCompletions, &mid, &caller())
            .await;
        assert!(matches!(alone, Outcome::Unchanged), "{alone:?}");
        let again = c
            .process(DialectKind::ChatCompletions, &mid, &caller())
            .await;
        assert_eq!(masked(&again), first);
    }

    #[tokio::test]
    async fn far_under_its_trigger_a_request_still_masks_the_conversations_floor() {
        let config = strategy(
            "hybrid",
            "[models.\"gpt-4o\"]\ncontext_window = 2500\n[models.big]\ncontext_window = 100000\n",
        );
        let messages = agent(12, 600);
        let (c, _) = compactor(&config, FakeSummarizer::text("never"));
        let first = masked(
            &c.process(DialectKind::ChatCompletions, &request(&messages), &caller())
                .await,
        );
        assert!(first > 0);
        // The same conversation sent to a model with a far larger window: nowhere near its
        // trigger, it masks what the first request masked, so the prefix stays as cached.
        let big = json!({"model": "big", "messages": messages})
            .to_string()
            .into_bytes();
        let again = c
            .process(DialectKind::ChatCompletions, &big, &caller())
            .await;
        assert_eq!(masked(&again), first);
        // A conversation the store holds no floor for is forwarded as sent.
        let (fresh, _) = compactor(&config, FakeSummarizer::text("never"));
        let alone = fresh
            .process(DialectKind::ChatCompletions, &big, &caller())
            .await;
        assert!(matches!(alone, Outcome::Unchanged), "{alone:?}");
    }

    #[tokio::test]
    async fn when_masking_cannot_reach_the_watermark_hybrid_moves_in_blocks_and_summarises_ahead() {
        // 1,600 tokens: trigger 1,360, watermark 952. Masked whole (about 1,100) the request is
        // under the trigger but not the watermark: masking moves by whole blocks (8 of the 9
        // old outputs, in blocks of 4), and a summary is made ahead.
        let (outcome, calls) = twelve_outputs("hybrid", 1_600, true).await;
        assert_eq!(masked(&outcome), 8);
        assert!(
            calls > 0,
            "a summary is made ahead (in as many attempts as it takes)"
        );
        // `summarize` makes one ahead as soon as the watermark is crossed.
        let (outcome, calls) = twelve_outputs("summarize", 3_500, true).await;
        assert!(matches!(outcome, Outcome::Unchanged), "{outcome:?}");
        assert_eq!(calls, 1);
    }

    #[tokio::test]
    async fn a_summary_made_ahead_stands_in_for_a_step_that_cannot_reach_the_watermark() {
        // 1,400 tokens: trigger 1,190, watermark 833. The first request masks every old output
        // (9) to get under its trigger, and a summary is made ahead.
        let mut config = strategy("hybrid", "[models.\"gpt-4o\"]\ncontext_window = 1400\n");
        config.compaction.background_ratio = 0.7;
        let fake = FakeSummarizer::text("Summary of the work so far.");
        let (c, _) = compactor(&config, fake.clone());
        let first = c
            .process(
                DialectKind::ChatCompletions,
                &request(&agent(12, 600)),
                &caller(),
            )
            .await;
        assert_eq!(masked(&first), 9);
        c.background_idle().await;
        let calls = fake.requests().len();
        assert!(calls > 0, "a summary is made ahead");
        // One output more: masking it too would bring the request under its trigger again but
        // not under the watermark, so each later request would mask one output more (a break
        // of the prompt cache every time). The summary made ahead stands in instead.
        let next = c
            .process(
                DialectKind::ChatCompletions,
                &request(&agent(13, 600)),
                &caller(),
            )
            .await;
        assert!(
            matches!(next, Outcome::Reused { .. } | Outcome::Rewritten { .. }),
            "{next:?}"
        );
        c.background_idle().await;
        assert_eq!(
            fake.requests().len(),
            calls,
            "no summary but the one made ahead"
        );
    }

    #[tokio::test]
    async fn when_whole_blocks_are_not_enough_hybrid_masks_every_old_output_before_it_summarises() {
        // 1,400 tokens: trigger 1,190, watermark 833. Masking cannot reach the watermark, and
        // whole blocks (8 of the 9 old outputs) leave the request over the trigger; all 9
        // bring it under. The request is masked, not held for a summary (one is made ahead),
        // as a summary would change the prefix as much.
        let (outcome, _) = twelve_outputs("hybrid", 1_400, true).await;
        let (masked, post_tokens) = masked_to(&outcome);
        assert_eq!(masked, 9);
        assert!(post_tokens < 1_190, "{post_tokens}");
        // Smaller still, masking everything is not enough: the request is summarised.
        let (outcome, calls) = twelve_outputs("hybrid", 1_200, true).await;
        assert!(matches!(outcome, Outcome::Rewritten { .. }), "{outcome:?}");
        assert!(calls > 0);
    }

    #[tokio::test]
    async fn when_no_summary_can_be_had_hybrid_masks_every_old_output_instead() {
        // Requests of 12 to 16 steps with the summarizer down; every old output (all but the 3
        // most recent) must be masked on each, and three failures open the breaker.
        async fn every_old_output_masked(extra: &str) {
            let config = strategy("hybrid", extra);
            let fake = FakeSummarizer::new(vec![crate::testing::Reply::Error]);
            let (c, metrics) = compactor(&config, fake.clone());
            for steps in 12..17 {
                let outcome = c
                    .process(
                        DialectKind::ChatCompletions,
                        &request(&agent(steps, 600)),
                        &caller(),
                    )
                    .await;
                assert_eq!(
                    masked(&outcome),
                    steps - 3,
                    "{extra}{steps} steps: {outcome:?}"
                );
            }
            assert_eq!(
                metrics.breaker_open.get(),
                1,
                "{extra}three failures opened it"
            );
            assert_eq!(
                fake.requests().len(),
                3,
                "{extra}no call past the open breaker"
            );
        }
        // 1,200 tokens, no background summaries: masking all 9 old outputs is not enough, so
        // the plan is a summary, which fails (and later the breaker is open).
        every_old_output_masked("[models.\"gpt-4o\"]\ncontext_window = 1200\n").await;
        // Past `max_messages` (masking cannot lower a count).
        every_old_output_masked("max_messages = 8\n").await;
    }

    #[tokio::test]
    async fn without_background_summaries_a_step_that_leaves_no_room_for_a_turn_is_a_summary() {
        // 1,400 tokens: trigger 1,190. Masking all 9 old outputs brings the request under it,
        // but by less than one more turn (a call and its ~200-token output): the next request
        // would be over again and mask one output more, a break of the prefix on every
        // request. With no summary made ahead to stand in, it is summarised now.
        let (outcome, calls) = twelve_outputs("hybrid", 1_400, false).await;
        assert!(matches!(outcome, Outcome::Rewritten { .. }), "{outcome:?}");
        assert!(calls > 0);
        // With room for a turn left (1,700: trigger 1,445) the step is taken.
        let (outcome, calls) = twelve_outputs("hybrid", 1_700, false).await;
        let (masked, post_tokens) = masked_to(&outcome);
        assert_eq!(masked, 9);
        assert!(post_tokens + 200 < 1_445, "{post_tokens}");
        assert_eq!(calls, 0);
    }

    #[tokio::test]
    async fn observations_sent_as_user_turns_are_masked_only_when_a_pattern_says_so() {
        // SWE-agent without function calling: each command's output comes back as the next
        // user message, ending with the shell prompt; so does the task.
        let footer = "\n(Current directory: /repo)\nbash-$";
        let mut messages = vec![
            json!({"role": "system", "content": "You run commands."}),
            json!({"role": "user", "content": format!("Fix the failing test.{}", footer)}),
        ];
        for i in 0..12 {
            messages.push(json!({"role": "assistant", "content": format!("```\ncat f{i}\n```")}));
            let mut out = format!("output {i} begins\n");
            while out.len() < 600 {
                out.push_str(&format!("line {} of output {i}\n", out.len()));
            }
            messages.push(json!({"role": "user", "content": format!("{out}{footer}")}));
        }
        messages.push(json!({"role": "user", "content": "A person's words, no prompt."}));
        let body = request(&messages);
        let pattern = "observation_pattern = '\\(Current directory: [^)]*\\)\\s*bash-\\$\\s*$'\n";
        let (c, _) = compactor(&strategy("mask", pattern), FakeSummarizer::text("s"));
        let Outcome::Masked {
            body: out, masked, ..
        } = c
            .process(DialectKind::ChatCompletions, &body, &caller())
            .await
        else {
            panic!("not masked");
        };
        // 12 observations, 3 kept: 8 masked in blocks of 4; the task is not among them.
        assert_eq!(masked, 8);
        let sent = messages_of(&out);
        assert_eq!(sent[1], messages[1], "the task is never an observation");
        for n in 0..12 {
            let got = sent[3 + 2 * n]["content"].as_str().expect("a string");
            if n < 8 {
                assert!(
                    got.starts_with("[output masked by compactor: observation, ")
                        && got.contains(&format!("first: output {n} begins"))
                        && got.ends_with("last: bash-$"),
                    "{n}: {got}"
                );
            } else {
                assert_eq!(sent[3 + 2 * n], messages[3 + 2 * n]);
            }
        }
        assert_eq!(sent.last(), messages.last());
        // Without a pattern, a person's turn is never masked.
        let (c, _) = compactor(&strategy("mask", ""), FakeSummarizer::text("s"));
        assert!(matches!(
            c.process(DialectKind::ChatCompletions, &body, &caller())
                .await,
            Outcome::Unchanged
        ));
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
        // Longer, the masked request is over too: one summary. Its tail is masked by the same
        // rule, counted from the first message after the summary: under the trigger, nothing.
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
        assert!(tail_outputs > 0, "{sent:?}");
        assert_eq!(masked, 0, "{sent:?}");
        assert!(result.post_tokens < 1_700, "{}", result.post_tokens);
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
