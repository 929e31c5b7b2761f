//! The compaction engine: decides when a conversation is too long, and replaces its older
//! turns with a summary. It works on the neutral [`crate::transcript`] only; reading and
//! writing wire JSON is the dialects' job (`src/dialect/`, beside this module), and applying a
//! compaction to a request (sessions, checkpoints, single flight) is the pipeline's, a layer
//! above.
//!
//! One module per concept: [`models`] (context windows by model name or glob), [`trigger`]
//! (when to compact, metric labels), [`boundary`] (which recent turns stay verbatim), [`mask_rule`]
//! (old tool outputs hidden from the summarizer), [`prompt`] (the compaction prompt and the
//! summary message), [`files`] (files read and modified, with [`shell`] splitting command
//! lines) and [`engine`] (one compaction: boundary, prompt, summarizer call, attempt limit).

pub mod boundary;
pub mod engine;
pub mod files;
pub mod mask_rule;
pub mod models;
pub mod prompt;
pub mod shell;
pub mod trigger;

pub use engine::{
    Attempts, CompactError, Compaction, CompactionInput, Engine, Prior, MAX_ATTEMPTS_PER_REQUEST,
};
pub use trigger::{CompactionOutcome, Limits, Trigger};

/// What a compaction produced: stored with the checkpoint, reported in metrics and headers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CompactionResult {
    /// The summary written by the summarizer (trimmed, never blank).
    pub summary: String,
    /// Files read during the conversation so far.
    pub read_files: Vec<String>,
    /// Files modified during the conversation so far.
    pub modified_files: Vec<String>,
    /// Estimated input tokens of the request as received.
    pub pre_tokens: usize,
    /// Estimated input tokens of the rewritten request.
    pub post_tokens: usize,
    /// 1-based number of this compaction within its conversation.
    pub compaction_num: u32,
}
