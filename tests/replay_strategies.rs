//! `compactor replay --strategy summarize,mask,hybrid` over the repository's transcripts: the
//! comparison table README's "Strategies" section shows is the one the replay prints today,
//! and its numbers keep what the section says of them (mask never calls the summarizer,
//! hybrid never costs more than summarize, masking keeps the prefix between its steps).

use std::path::Path;
use std::process::Command;

const README: &str = include_str!("../README.md");

/// The replay's command line, as README gives it.
const ARGS: [&str; 5] = [
    "replay",
    "--config",
    "tests/fixtures/transcripts/strategies.toml",
    "--strategy",
    "summarize,mask,hybrid",
];

const TRANSCRIPTS: [&str; 4] = [
    "swe-agent-ctf-katy.json",
    "swe-agent-ctf-web.json",
    "swe-agent-function-calling-simple.json",
    "swe-agent-marshmallow-function-calling.json",
];

/// Runs `compactor` with `args` from the repository root; its stdout.
fn compactor(args: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(args)
        .current_dir(root)
        .env_remove("COMPACTOR_COMPACTION__STRATEGY")
        .output()
        .expect("run compactor");
    assert!(
        out.status.success(),
        "compactor {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The `== strategies` table at the end of a replay's output.
fn table(output: &str) -> &str {
    let at = output.find("== strategies").expect("a comparison table");
    output[at..].trim_end()
}

/// The fenced block of README that follows the replay command.
fn readme_table() -> &'static str {
    let command = format!(
        "compactor {} tests/fixtures/transcripts/*.json",
        ARGS.join(" ")
    );
    let at = README
        .find(&command)
        .expect("README gives the replay command");
    let rest = &README[at..];
    let open = rest.find("```\n== strategies").expect("the table after it") + 4;
    let len = rest[open..].find("\n```").expect("the table's end");
    &rest[open..open + len]
}

/// One row of the table.
#[derive(Debug)]
struct Row {
    file: String,
    strategy: String,
    calls: usize,
    tokens: usize,
    masked: usize,
    stable: usize,
    compared: usize,
}

fn rows(table: &str) -> Vec<Row> {
    table
        .lines()
        .skip(2)
        .map(|line| {
            let cells: Vec<&str> = line.split_whitespace().collect();
            let n = |i: usize| -> usize { cells[i].parse().expect("a number") };
            let (stable, compared) = cells[5].split_once('/').expect("stable/compared");
            Row {
                file: cells[0].to_string(),
                strategy: cells[1].to_string(),
                calls: n(2),
                tokens: n(3),
                masked: n(4),
                stable: stable.parse().expect("a number"),
                compared: compared.parse().expect("a number"),
            }
        })
        .collect()
}

#[test]
fn the_readme_table_is_the_replay_of_the_transcripts() {
    let mut args: Vec<String> = ARGS.iter().map(|a| a.to_string()).collect();
    args.extend(
        TRANSCRIPTS
            .iter()
            .map(|t| format!("tests/fixtures/transcripts/{t}")),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = compactor(&args);
    assert_eq!(
        table(&output),
        readme_table(),
        "README's strategy table is out of date; replay prints:\n{output}"
    );

    let rows = rows(table(&output));
    assert_eq!(rows.len(), TRANSCRIPTS.len() * 3);
    for file in TRANSCRIPTS {
        let of = |strategy: &str| {
            rows.iter()
                .find(|r| r.file == file && r.strategy == strategy)
                .unwrap_or_else(|| panic!("no {strategy} row for {file}"))
        };
        let (summarize, mask, hybrid) = (of("summarize"), of("mask"), of("hybrid"));
        assert_eq!(mask.calls, 0, "{file}: mask never summarises");
        assert!(hybrid.calls <= summarize.calls, "{file}: {hybrid:?}");
        assert!(hybrid.tokens <= summarize.tokens, "{file}: {hybrid:?}");
        assert_eq!(summarize.masked, 0, "{file}: summarize masks nothing");
        // Without summaries only a mask step changes the prefix: none without masked outputs.
        if mask.masked == 0 {
            assert_eq!(mask.stable, mask.compared, "{file}: {mask:?}");
        }
        assert_eq!(summarize.compared, mask.compared);
    }
}

#[test]
fn an_unknown_strategy_is_refused_by_name() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args([
            "replay",
            "--strategy",
            "summarize,squash",
            "tests/fixtures/transcripts/swe-agent-function-calling-simple.json",
        ])
        .current_dir(root)
        .output()
        .expect("run compactor");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown strategy `squash`"), "{stderr}");
}

/// README's figures for masking that acts: the marshmallow transcript with a 10,000-token
/// window, `keep_recent_outputs = 2`, `mask_block = 4`.
#[test]
fn with_outputs_old_enough_masking_saves_tokens_at_the_same_summarizer_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("masking.toml");
    std::fs::write(
        &config,
        "[compaction]\nmin_preserve_tokens = 500\nmax_preserve_tokens = 1500\n\
         keep_recent_outputs = 2\nmask_block = 4\n[models.\"gpt-4o\"]\ncontext_window = 10000\n",
    )
    .expect("write config");
    let output = compactor(&[
        "replay",
        "--config",
        config.to_str().expect("utf-8 path"),
        "--strategy",
        "summarize,hybrid",
        "tests/fixtures/transcripts/swe-agent-marshmallow-function-calling.json",
    ]);
    let rows = rows(table(&output));
    let (summarize, hybrid) = (&rows[0], &rows[1]);
    assert_eq!(
        (
            summarize.calls,
            summarize.tokens,
            summarize.stable,
            summarize.compared
        ),
        (1, 50_624, 11, 11),
        "{output}"
    );
    assert_eq!(
        (hybrid.calls, hybrid.tokens, hybrid.stable, hybrid.compared),
        (1, 38_578, 9, 11),
        "{output}"
    );
    assert!(README.contains("forwards 38,578\n  tokens under `hybrid` against 50,624"));
}
