//! When to compact: too many messages, or too many estimated tokens (docs/architecture.md,
//! *Trigger*).
//!
//! A request is compacted when its message count exceeds `max_messages`, or when its
//! estimated input tokens reach `trigger_ratio × context_window − reserved_output`. The
//! reserved output is the request's own `max_completion_tokens` (or `max_tokens`), since
//! providers count it against the same window; it is capped at half the window so a client
//! that asks for an absurd output budget does not make every request compact. When both
//! conditions hold, the message trigger is reported. [`Trigger`] and [`CompactionOutcome`] are
//! the bounded label values of `compactor_compactions_total`.

use crate::config::CompactionConfig;

/// Smallest share of the limits a background summary is made for ([`Limits::for_background`]).
pub const MIN_BACKGROUND_SCALE: f64 = 0.2;

/// Default `compaction.max_messages`: compact when a request holds more messages than this.
pub const DEFAULT_MAX_MESSAGES: usize = 80;

/// Why a compaction ran: the `trigger` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The message count exceeded `max_messages`.
    Messages,
    /// The estimated tokens reached the threshold.
    Tokens,
    /// Requested through the admin API (`POST /session/{id}/summarize`).
    Manual,
    /// The provider refused the request for its length; compacted to retry it.
    Overflow,
    /// Below the other triggers, compacting pays: the prompt-cache reads of what a summary
    /// removes have cost more than making it (`compaction.cost_trigger`).
    Cost,
}

impl Trigger {
    /// Every trigger (the metrics pre-initialise their label values).
    pub const ALL: [Trigger; 5] = [
        Trigger::Messages,
        Trigger::Tokens,
        Trigger::Manual,
        Trigger::Overflow,
        Trigger::Cost,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Trigger::Messages => "messages",
            Trigger::Tokens => "tokens",
            Trigger::Manual => "manual",
            Trigger::Overflow => "overflow",
            Trigger::Cost => "cost",
        }
    }
}

/// How a compaction ended: the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompactionOutcome {
    /// The request was rewritten.
    Compacted,
    /// Compaction was needed but did not happen (summarizer error or timeout, nothing to
    /// compact, unparseable body, or a rewrite that would not be smaller).
    Failed,
    /// The summarizer returned an empty or whitespace-only summary.
    Blank,
    /// The per-session breaker skipped compaction.
    Breaker,
    /// Compaction panicked (a bug); the original request was forwarded.
    Panic,
    /// A manual compaction's summary was made but its checkpoint could not be stored: the
    /// session goes on without it (the answer says `compacted: false`).
    NotStored,
}

impl CompactionOutcome {
    /// Every outcome (the metrics pre-initialise their label values).
    pub const ALL: [CompactionOutcome; 6] = [
        CompactionOutcome::Compacted,
        CompactionOutcome::Failed,
        CompactionOutcome::Blank,
        CompactionOutcome::Breaker,
        CompactionOutcome::Panic,
        CompactionOutcome::NotStored,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            CompactionOutcome::Compacted => "compacted",
            CompactionOutcome::Failed => "failed",
            CompactionOutcome::Blank => "blank",
            CompactionOutcome::Breaker => "breaker",
            CompactionOutcome::Panic => "panic",
            CompactionOutcome::NotStored => "not_stored",
        }
    }
}

/// The limits one request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The model's context window.
    pub context_window: usize,
    /// The window the summarizer's prompt and summary must fit: `context_window`, except for
    /// a request enabling a longer window than its model's usual one, whose flag the
    /// summarizer's own call does not carry (then the usual window).
    pub summarizer_window: usize,
    /// Output tokens the request reserves in that window.
    pub reserved_output: usize,
    /// Compact at or above this many estimated input tokens.
    pub token_threshold: usize,
    /// A request over the trigger whose summary is already being made (in the background, or
    /// by another request) goes on without waiting for it below this many estimated input
    /// tokens: three quarters of the way from `token_threshold` to the usable window: room the
    /// provider accepts, with the calibrated estimate's error to spare (a refusal is still
    /// compacted and retried). At or above it, the request waits.
    pub wait_threshold: usize,
    /// Compact above this many messages.
    pub max_messages: usize,
    /// The most estimated tokens a conversation's opening may hold to be kept verbatim in the
    /// head ([`crate::transcript::Transcript::keeping_opening`]): a third of the token trigger
    /// before the output reserve, so a kept opening leaves room below the trigger for a
    /// summary and a tail. It depends only on the model's window and the trigger ratio, not on
    /// the request, so every request of a conversation agrees on its head.
    pub opening_budget: usize,
}

impl Limits {
    /// The limits for a model with `context_window` tokens and a request asking for
    /// `requested_output` output tokens.
    pub fn new(
        config: &CompactionConfig,
        context_window: usize,
        requested_output: Option<usize>,
    ) -> Limits {
        let reserved_output = requested_output.unwrap_or(0).min(context_window / 2);
        // `as` saturates: NaN and negatives become 0.
        let scaled =
            ((config.trigger_ratio * context_window as f64).floor() as usize).min(context_window);
        let token_threshold = scaled.saturating_sub(reserved_output);
        let usable = context_window.saturating_sub(reserved_output);
        Limits {
            context_window,
            summarizer_window: context_window,
            reserved_output,
            token_threshold,
            wait_threshold: token_threshold + usable.saturating_sub(token_threshold) * 3 / 4,
            max_messages: config.max_messages,
            opening_budget: scaled / 3,
        }
    }

    /// These limits with the summarizer held to `window` (at most the context window).
    pub fn with_summarizer_window(self, window: usize) -> Limits {
        Limits {
            summarizer_window: window.min(self.context_window),
            ..self
        }
    }

    /// These limits with the token threshold divided by `factor`, the model's observed
    /// actual ÷ estimated token ratio: comparing a raw estimate with the result is comparing
    /// the calibrated estimate with the original threshold. Factors that are not positive
    /// and finite leave the limits unchanged.
    pub fn calibrated(self, factor: f64) -> Limits {
        if !(factor.is_finite() && factor > 0.0) {
            return self;
        }
        // `as` saturates.
        let calibrate = |n: usize| (n as f64 / factor).floor() as usize;
        Limits {
            token_threshold: calibrate(self.token_threshold),
            wait_threshold: calibrate(self.wait_threshold),
            ..self
        }
    }

    /// These limits made to fit a provider's refusal for length: the window it named (when
    /// it named one), and a token threshold scaled by how much more the provider counted than
    /// the estimate (`requested` against `estimated`), never above three quarters of what was
    /// refused, so the retry is smaller than the request that failed.
    pub fn after_refusal(
        self,
        config: &CompactionConfig,
        window: Option<usize>,
        requested: Option<usize>,
        estimated: usize,
    ) -> Limits {
        let base = match window {
            Some(w) if w > 0 => Limits::new(config, w, Some(self.reserved_output)),
            _ => self,
        };
        let scaled = match requested {
            Some(r) if r > estimated && estimated > 0 => {
                (base.token_threshold as f64 * estimated as f64 / r as f64) as usize
            }
            _ => base.token_threshold,
        };
        let token_threshold = scaled.min(estimated.saturating_mul(3) / 4);
        Limits {
            token_threshold,
            // The window was just shown to be smaller than believed: no room is trusted
            // beyond the trigger.
            wait_threshold: token_threshold,
            summarizer_window: base.summarizer_window.min(self.summarizer_window),
            ..base
        }
    }

    /// The window left for input once the output is reserved.
    pub fn usable_window(&self) -> usize {
        self.context_window.saturating_sub(self.reserved_output)
    }

    /// The soft watermark below these limits at which a summary is started in the background
    /// (`compaction.background_ratio` of the token threshold and of `max_messages`); `None`
    /// when background summaries are off.
    pub fn watermark(&self, ratio: f64) -> Option<Limits> {
        (ratio > 0.0 && ratio < 1.0).then(|| self.scaled(ratio))
    }

    /// These background limits (a [`Limits::watermark`] of `trigger`) lowered so a summary
    /// starts `tokens` and `messages` before `trigger`, when that is earlier: a conversation
    /// predicted to grow that much while the summary is written then finds it ready. Never
    /// below half the trigger, where a summary would cover too little to be worth it.
    pub fn earlier_by(self, trigger: &Limits, tokens: usize, messages: usize) -> Limits {
        let ahead = |at: usize, of: usize, by: usize| at.min(of.saturating_sub(by).max(of / 2));
        Limits {
            token_threshold: ahead(self.token_threshold, trigger.token_threshold, tokens),
            max_messages: ahead(self.max_messages, trigger.max_messages, messages).max(1),
            ..self
        }
    }

    /// The limits a background summary is made for. The conversation grows by `1 − ratio` of
    /// the trigger between the watermark and the request that splices the summary, so the
    /// summary keeps a shorter verbatim tail: made for `max_messages` scaled by `2·ratio − 1`
    /// (at least [`MIN_BACKGROUND_SCALE`]), the spliced request lands near half the message
    /// limit, as a compaction on the request path does, instead of starting the next one at
    /// once. The token threshold stays: the token tail is the preserve budget (at most
    /// `max_preserve_tokens`), already far below the watermark, and a tighter threshold would
    /// only make the engine try again with a smaller tail (another summarizer call).
    pub fn for_background(&self, ratio: f64) -> Limits {
        // Rounded so 0.7 gives 0.4, not 0.39999999999999997.
        let factor = ((2.0 * ratio - 1.0) * 1e6).round() / 1e6;
        Limits {
            max_messages: self.scaled(factor.max(MIN_BACKGROUND_SCALE)).max_messages,
            ..*self
        }
    }

    /// These limits less room for `messages` more messages of `tokens` more estimated tokens:
    /// a request under them leaves that room under these.
    pub fn less(&self, messages: usize, tokens: usize) -> Limits {
        Limits {
            token_threshold: self.token_threshold.saturating_sub(tokens),
            wait_threshold: self.wait_threshold.saturating_sub(tokens),
            max_messages: self.max_messages.saturating_sub(messages),
            ..*self
        }
    }

    /// The token threshold and message limit scaled by `factor` (the window and the reserved
    /// output stay).
    fn scaled(&self, factor: f64) -> Limits {
        // `as` saturates.
        let scale = |n: usize| (n as f64 * factor).floor() as usize;
        Limits {
            token_threshold: scale(self.token_threshold),
            max_messages: scale(self.max_messages).max(1),
            ..*self
        }
    }

    /// Which trigger fires for a request of `messages` messages and `tokens` estimated tokens.
    pub fn check(&self, messages: usize, tokens: usize) -> Option<Trigger> {
        if messages > self.max_messages {
            Some(Trigger::Messages)
        } else if tokens >= self.token_threshold {
            Some(Trigger::Tokens)
        } else {
            None
        }
    }
}

/// How a background summary ended: the `outcome` label of
/// `compactor_background_compactions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackgroundOutcome {
    /// Stored as a staged checkpoint for the request that crosses the trigger.
    Stored,
    /// The summarizer failed, or nothing could be compacted.
    Failed,
    /// The conversation was edited while it was made: thrown away.
    Discarded,
    /// Not needed after all: another summary of the prefix was stored first.
    Skipped,
    /// Not started: `summarizer.max_concurrent` summaries were already running.
    Busy,
    /// Aborted by shutdown.
    Abandoned,
    /// Not made: the conversation's breaker is open.
    Breaker,
    /// Nothing worth summarising ahead yet: everything is in the tail a request keeps, or a
    /// summary would not make the request smaller (no warning: nothing went wrong).
    NotNeeded,
}

impl BackgroundOutcome {
    /// Every outcome (the metrics pre-initialise their label values).
    pub const ALL: [BackgroundOutcome; 8] = [
        BackgroundOutcome::Stored,
        BackgroundOutcome::Failed,
        BackgroundOutcome::Discarded,
        BackgroundOutcome::Skipped,
        BackgroundOutcome::Busy,
        BackgroundOutcome::Abandoned,
        BackgroundOutcome::Breaker,
        BackgroundOutcome::NotNeeded,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            BackgroundOutcome::Stored => "stored",
            BackgroundOutcome::Failed => "failed",
            BackgroundOutcome::Discarded => "discarded",
            BackgroundOutcome::Skipped => "skipped",
            BackgroundOutcome::Busy => "busy",
            BackgroundOutcome::Abandoned => "abandoned",
            BackgroundOutcome::Breaker => "breaker",
            BackgroundOutcome::NotNeeded => "not_needed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> CompactionConfig {
        CompactionConfig::default()
    }

    #[test]
    fn default_max_messages_is_80_and_the_config_default_agrees() {
        assert_eq!(DEFAULT_MAX_MESSAGES, 80);
        assert_eq!(config().max_messages, DEFAULT_MAX_MESSAGES);
    }

    #[test]
    fn message_count_must_exceed_the_maximum() {
        let l = Limits::new(&config(), 128_000, None);
        assert_eq!(l.check(80, 0), None);
        assert_eq!(l.check(81, 0), Some(Trigger::Messages));
    }

    #[test]
    fn token_threshold_is_ratio_of_window_minus_reserved_output() {
        let l = Limits::new(&config(), 128_000, None);
        assert_eq!(l.token_threshold, 108_800);
        assert_eq!(l.check(2, 108_799), None);
        assert_eq!(l.check(2, 108_800), Some(Trigger::Tokens));
        let l = Limits::new(&config(), 128_000, Some(10_000));
        assert_eq!(l.token_threshold, 98_800);
        assert_eq!(l.usable_window(), 118_000);
        assert_eq!(l.check(2, 98_800), Some(Trigger::Tokens));
    }

    #[test]
    fn reserved_output_is_capped_at_half_the_window() {
        let l = Limits::new(&config(), 8_192, Some(1_000_000));
        assert_eq!(l.reserved_output, 4_096);
        assert_eq!(l.token_threshold, 6_963 - 4_096);
    }

    #[test]
    fn the_summarizer_window_is_held_through_a_refusal() {
        let l = Limits::new(&config(), 1_000_000, None);
        assert_eq!(l.summarizer_window, 1_000_000);
        let l = l.with_summarizer_window(200_000);
        assert_eq!(l.summarizer_window, 200_000);
        assert_eq!(
            l.with_summarizer_window(5_000_000).summarizer_window,
            1_000_000
        );
        // The provider names its window: the summarizer's never grows past what it was.
        let refused = l.after_refusal(&config(), Some(900_000), None, 950_000);
        assert_eq!(refused.context_window, 900_000);
        assert_eq!(refused.summarizer_window, 200_000);
        let small = l.after_refusal(&config(), Some(100_000), None, 150_000);
        assert_eq!(small.summarizer_window, 100_000);
    }

    #[test]
    fn the_watermark_scales_both_triggers_and_zero_turns_it_off() {
        let l = Limits::new(&config(), 128_000, None);
        let w = l.watermark(0.7).expect("on");
        assert_eq!(w.token_threshold, 76_160);
        assert_eq!(w.max_messages, 56);
        assert_eq!(w.context_window, l.context_window);
        assert_eq!(w.check(56, 76_159), None);
        assert_eq!(w.check(57, 0), Some(Trigger::Messages));
        assert_eq!(w.check(2, 76_160), Some(Trigger::Tokens));
        let b = l.for_background(0.7);
        assert_eq!((b.token_threshold, b.max_messages), (l.token_threshold, 32));
        assert_eq!(
            l.for_background(0.5).max_messages,
            16,
            "never below a fifth"
        );
        assert_eq!(l.watermark(0.0), None);
        assert_eq!(l.watermark(1.0), None);
        assert_eq!(l.watermark(f64::NAN), None);
    }

    #[test]
    fn a_predicted_lead_moves_the_watermark_earlier_down_to_half_the_trigger() {
        let l = Limits::new(&config(), 128_000, None); // 108,800 tokens, 80 messages
        let w = l.watermark(0.7).expect("on"); // 76,160 tokens, 56 messages
        let e = w.earlier_by(&l, 40_000, 30);
        assert_eq!((e.token_threshold, e.max_messages), (68_800, 50));
        let small = w.earlier_by(&l, 1_000, 2);
        assert_eq!(
            (small.token_threshold, small.max_messages),
            (76_160, 56),
            "never later than the watermark"
        );
        let huge = w.earlier_by(&l, usize::MAX, usize::MAX);
        assert_eq!((huge.token_threshold, huge.max_messages), (54_400, 40));
        assert_eq!(huge.context_window, l.context_window);
    }

    #[test]
    fn messages_take_precedence_when_both_fire() {
        let l = Limits::new(&config(), 1_000, None);
        assert_eq!(l.check(81, 1_000_000), Some(Trigger::Messages));
    }

    #[test]
    fn labels_are_stable() {
        assert_eq!(Trigger::Messages.label(), "messages");
        assert_eq!(Trigger::Tokens.label(), "tokens");
        assert_eq!(Trigger::Manual.label(), "manual");
        assert_eq!(CompactionOutcome::Compacted.label(), "compacted");
        assert_eq!(CompactionOutcome::Failed.label(), "failed");
        assert_eq!(CompactionOutcome::Blank.label(), "blank");
        assert_eq!(CompactionOutcome::Breaker.label(), "breaker");
    }
}
