//! What more than one bench needs: a summarizer that answers at once with a fixed summary, so
//! a bench measures compactor and not an LLM.

use compactor_plugin_api::{BoxFuture, SummarizeError, Summarizer, Summary, SummaryRequest};

/// Answers at once with a fixed summary.
pub struct InstantSummarizer;

impl Summarizer for InstantSummarizer {
    fn name(&self) -> &str {
        "instant"
    }

    fn summarize<'a>(
        &'a self,
        _request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(async {
            Summary::new("1. Primary Request and Intent: fix the bug.\n8. Current Work: tests.")
        })
    }
}
