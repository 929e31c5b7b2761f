//! Observation masking (docs/architecture.md, *Masking of old observations*): which old tool
//! outputs are hidden, and what stands in for them.
//!
//! Two places mask. In the transcript handed to the summarizer, every tool output except the
//! [`PRESERVE_RECENT_OUTPUTS`] most recent ones is replaced by [`MASKED_OUTPUT`]
//! ([`mask_observations`]): old observations (file dumps, test logs) dominate agent
//! transcripts but rarely matter to a summary; the recent ones describe the current state of
//! the work. "Most recent" counts within the turns being summarised, since the preserved tail
//! is forwarded verbatim anyway.
//!
//! With `compaction.strategy` `mask` or `hybrid`, the forwarded request is masked too: its
//! oldest outputs are replaced by a [`placeholder`] (call id, tool name, size, first and last
//! lines). Which ones is the [`MaskRule`]: a pure function of how many outputs the forwarded
//! conversation holds, moving in blocks so the forwarded prefix stays byte-identical between
//! mask steps (the provider's prompt cache keeps hitting). Finding outputs in wire JSON and
//! replacing them is the dialects' job; applying the rule to a request is the pipeline's.

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

/// Which outputs of the forwarded conversation are masked: all but the `keep_recent` most
/// recent, rounded down to a multiple of `block`, counted from the first output of the
/// forwarded conversation (after any stored summary). Growing the conversation by one output
/// changes the masked set only when it crosses a multiple of `block`, and then by `block`
/// outputs at once, so between two mask steps every request forwards the same bytes for
/// everything the previous request carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskRule {
    /// Most recent outputs never masked.
    pub keep_recent: usize,
    /// Outputs masked at a time (at least 1).
    pub block: usize,
}

impl MaskRule {
    /// How many of the first outputs are masked when the forwarded conversation holds
    /// `outputs`.
    pub fn masked(&self, outputs: usize) -> usize {
        let block = self.block.max(1);
        outputs.saturating_sub(self.keep_recent) / block * block
    }
}

/// Longest piece of the first or last line a placeholder quotes, in characters.
pub const PLACEHOLDER_LINE_CHARS: usize = 120;

/// What stands in for a masked output in the forwarded request: the call it answers (id and
/// tool name, when known), the output's size (characters and lines of its text, and images),
/// and its first and last non-blank lines (each cut to [`PLACEHOLDER_LINE_CHARS`]), so the
/// model still knows what it ran and roughly what came back, and can run it again.
pub fn placeholder(call_id: Option<&str>, tool: Option<&str>, text: &str, images: usize) -> String {
    let mut lines = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty());
    let first = lines.next();
    let last = lines.next_back();
    let line_count = text.lines().count();
    let mut out = String::from("[output masked by compactor: ");
    match tool {
        Some(t) => out.push_str(t),
        None => out.push_str("tool"),
    }
    if let Some(id) = call_id {
        out.push_str(" call ");
        out.push_str(id);
    }
    out.push_str(&format!(
        ", {} chars in {} lines",
        text.chars().count(),
        line_count
    ));
    if images > 0 {
        out.push_str(&format!(", {images} images"));
    }
    out.push(']');
    for (label, line) in [("first", first), ("last", last)] {
        if let Some(line) = line {
            out.push('\n');
            out.push_str(label);
            out.push_str(": ");
            out.push_str(&cut(line));
        }
    }
    out
}

/// `line` cut to [`PLACEHOLDER_LINE_CHARS`] characters, marked with `…` when cut.
fn cut(line: &str) -> String {
    match line.char_indices().nth(PLACEHOLDER_LINE_CHARS) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use compactor_plugin_api::Role;

    #[test]
    fn the_rule_masks_in_blocks_and_keeps_the_recent_outputs() {
        let rule = MaskRule {
            keep_recent: 5,
            block: 10,
        };
        let masked: Vec<usize> = (0..40).map(|n| rule.masked(n)).collect();
        assert_eq!(
            &masked[..15],
            &[0; 15],
            "nothing until a whole block is old"
        );
        assert_eq!(&masked[15..25], &[10; 10]);
        assert_eq!(&masked[25..35], &[20; 10]);
        assert_eq!(masked[35], 30);
        for n in 0..40 {
            assert!(
                n - rule.masked(n) >= n.min(5),
                "{n}: the 5 most recent stay"
            );
        }
        // A block of 1 masks everything but the recent ones; a zero block is read as 1.
        let every = MaskRule {
            keep_recent: 2,
            block: 1,
        };
        assert_eq!((every.masked(1), every.masked(7)), (0, 5));
        assert_eq!(MaskRule { block: 0, ..every }.masked(7), 5);
    }

    #[test]
    fn a_placeholder_names_the_call_its_size_and_its_ends() {
        let text = "\r\n[File: src/a.rs (3 lines)]\r\n1:fn a() {}\r\n\r\nbash-$ \n\n";
        let p = placeholder(Some("call_1"), Some("bash"), text, 0);
        assert_eq!(
            p,
            format!(
                "[output masked by compactor: bash call call_1, {} chars in 6 lines]\n\
                 first: [File: src/a.rs (3 lines)]\nlast: bash-$",
                text.chars().count()
            )
        );
        let long = "é".repeat(500);
        let p = placeholder(None, None, &format!("{long}\nok"), 2);
        assert!(p.starts_with("[output masked by compactor: tool, 503 chars in 2 lines, 2 images]"));
        assert!(p.contains(&format!("first: {}…\n", "é".repeat(PLACEHOLDER_LINE_CHARS))));
        assert!(p.ends_with("last: ok"));
        assert_eq!(
            placeholder(Some("c"), Some("t"), "", 0),
            "[output masked by compactor: t call c, 0 chars in 0 lines]"
        );
    }

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
