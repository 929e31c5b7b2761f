//! Observation masking (docs/architecture.md, *Masking of old observations*).
//!
//! In the transcript handed to the summarizer (never in the forwarded request), every tool
//! output except the [`PRESERVE_RECENT_OUTPUTS`] most recent ones is replaced by
//! [`MASKED_OUTPUT`]. Old observations (file dumps, test logs) dominate agent transcripts but
//! rarely matter to a summary; the recent ones describe the current state of the work. "Most
//! recent" counts within the turns being summarised, since the preserved tail is forwarded
//! verbatim anyway.

use compactor_plugin_api::{Entry, Part};

/// Tool results kept verbatim when masking: the most recent ones describe the current work.
pub const PRESERVE_RECENT_OUTPUTS: usize = 5;

/// What a masked tool output reads as.
pub const MASKED_OUTPUT: &str = "[output masked for compaction]";

/// Masks all tool outputs in `entries` except the `keep_recent` most recent; returns how many
/// were masked.
pub fn mask_observations(entries: &mut [Entry], keep_recent: usize) -> usize {
    let total = entries
        .iter()
        .flat_map(|e| e.parts.iter())
        .filter(|p| matches!(p, Part::ToolResult { .. }))
        .count();
    let to_mask = total.saturating_sub(keep_recent);
    let mut masked = 0;
    for part in entries.iter_mut().flat_map(|e| e.parts.iter_mut()) {
        if masked == to_mask {
            break;
        }
        if let Part::ToolResult { output, .. } = part {
            *output = MASKED_OUTPUT.to_string();
            masked += 1;
        }
    }
    masked
}

#[cfg(test)]
mod tests {
    use super::*;
    use compactor_plugin_api::Role;

    fn result(i: usize) -> Part {
        Part::ToolResult {
            name: "bash".into(),
            output: format!("out {i}"),
            is_error: false,
        }
    }

    fn outputs(entries: &[Entry]) -> Vec<String> {
        entries
            .iter()
            .flat_map(|e| e.parts.iter())
            .filter_map(|p| match p {
                Part::ToolResult { output, .. } => Some(output.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn constants_are_5_and_the_masked_text() {
        assert_eq!(PRESERVE_RECENT_OUTPUTS, 5);
        assert_eq!(MASKED_OUTPUT, "[output masked for compaction]");
    }

    #[test]
    fn all_but_the_five_most_recent_outputs_are_masked() {
        let mut entries: Vec<Entry> = (0..8)
            .map(|i| Entry {
                role: Role::Assistant,
                parts: vec![
                    Part::Text {
                        text: format!("step {i}"),
                    },
                    result(i),
                ],
            })
            .collect();
        assert_eq!(mask_observations(&mut entries, PRESERVE_RECENT_OUTPUTS), 3);
        let outs = outputs(&entries);
        assert_eq!(&outs[..3], &[MASKED_OUTPUT; 3]);
        assert_eq!(&outs[3..], &["out 3", "out 4", "out 5", "out 6", "out 7"]);
        assert!(
            matches!(&entries[0].parts[0], Part::Text { text } if text == "step 0"),
            "text is never masked"
        );
    }

    #[test]
    fn parallel_results_in_one_entry_count_individually() {
        let mut entries = vec![Entry {
            role: Role::Assistant,
            parts: (0..7).map(result).collect(),
        }];
        assert_eq!(mask_observations(&mut entries, 5), 2);
        assert_eq!(outputs(&entries)[2], "out 2");
    }

    #[test]
    fn few_outputs_are_left_alone() {
        let mut entries = vec![Entry {
            role: Role::Assistant,
            parts: (0..5).map(result).collect(),
        }];
        assert_eq!(mask_observations(&mut entries, 5), 0);
        assert_eq!(mask_observations(&mut [], 5), 0);
    }
}
