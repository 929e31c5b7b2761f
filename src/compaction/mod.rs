//! The compaction engine (seed §5): decides when a conversation is too long, and replaces its
//! older turns with a summary.
//!
//! One module per concept: [`transcript`] (the neutral model dialects parse into),
//! [`estimate`] (tokens without a tokenizer), [`models`] (context windows by model name or
//! glob), [`trigger`] (when to compact, metric labels), [`boundary`] (which recent turns stay
//! verbatim), [`mask`] (old tool outputs hidden from the summarizer), [`prompt`] (the
//! compaction prompt and the summary message), [`files`] (files read and modified, with [`shell`] splitting command lines), and
//! [`processor`] (the engine with its circuit breaker) and [`compactor`] (the request-level
//! flow with session memory: splice, trigger, single flight, checkpoints). The engine never sees wire JSON; dialects in
//! [`crate::dialect`] do the reading and writing.

pub mod boundary;
pub mod compactor;
pub mod estimate;
pub mod files;
pub mod mask;
pub mod models;
pub mod processor;
pub mod prompt;
pub mod shell;
pub mod transcript;
pub mod trigger;

#[cfg(test)]
mod props;
#[cfg(test)]
pub(crate) mod testing;

pub use compactor::{Compactor, ForwardedEstimate, ManualOutcome, Processed, RequestContext};
pub use processor::{
    CompactError, Compaction, CompactionInput, Engine, Prior, COMPACTION_CIRCUIT_BREAKER_THRESHOLD,
};
pub use trigger::{CompactionOutcome, Limits, Trigger};

/// What a compaction produced (seed §5.6).
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// What the proxy should forward.
#[derive(Debug, Default)]
pub enum Outcome {
    /// No compaction needed (or the body is not one compactor understands): forward the
    /// original bytes.
    #[default]
    Unchanged,
    /// Forward this body instead of the original.
    Rewritten {
        /// The rewritten request body.
        body: bytes::Bytes,
        /// What the compaction produced.
        result: CompactionResult,
        /// Which trigger fired.
        trigger: Trigger,
    },
    /// No new compaction, but a stored summary of this conversation stands in for the prefix
    /// it covers: forward this body.
    Reused {
        /// The request with the stored summary spliced in.
        body: bytes::Bytes,
        /// The stored compaction's figures, with this request's token estimates.
        result: CompactionResult,
    },
    /// Compaction was needed but did not happen (already counted and logged): forward the
    /// original bytes.
    Failed,
}
