//! `compactor replay --strategy summarize,mask,hybrid` over the repository's transcripts: the
//! comparison table README's "Strategies" section shows is the one the replay prints today,
//! and its numbers keep what the section says of them (mask never calls the summarizer,
//! hybrid never makes more summarizer calls than summarize, masking keeps the prefix between
//! its steps), and so does the sweep of windows and mask blocks beside it.

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

/// `compactor replay --config config --strategy strategies` over the four transcripts.
fn replay(config: &str, strategies: &str) -> String {
    let mut args = vec!["replay", "--config", config, "--strategy", strategies];
    let files: Vec<String> = TRANSCRIPTS
        .iter()
        .map(|t| format!("tests/fixtures/transcripts/{t}"))
        .collect();
    args.extend(files.iter().map(String::as_str));
    compactor(&args)
}

#[test]
fn the_readme_table_is_the_replay_of_the_transcripts() {
    let output = replay(ARGS[2], ARGS[4]);
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
        if summarize.calls > 0 {
            assert!(mask.tokens > summarize.tokens, "{file}: {mask:?}");
        }
        assert!(hybrid.calls <= summarize.calls, "{file}: {hybrid:?}");
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

/// The windows of README's sweep.
const SWEEP_WINDOWS: [usize; 6] = [4_000, 6_000, 8_000, 10_000, 12_000, 16_000];

/// One line of the sweep: the four transcripts replayed under `summarize` and `hybrid` with a
/// `window`-token context window, the rest as in `strategies.toml`, summed.
fn sweep_line(dir: &Path, window: usize) -> (String, [usize; 2]) {
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transcripts/strategies.toml"),
    )
    .expect("strategies.toml");
    let config = base.replace(
        "context_window = 4000",
        &format!("context_window = {window}"),
    );
    assert!(config.contains(&format!("context_window = {window}")));
    let path = dir.join(format!("sweep-{window}.toml"));
    std::fs::write(&path, config).expect("write config");
    let output = replay(path.to_str().expect("utf-8 path"), "summarize,hybrid");
    let rows = rows(table(&output));
    let sum = |strategy: &str, f: fn(&Row) -> usize| -> usize {
        rows.iter().filter(|r| r.strategy == strategy).map(f).sum()
    };
    let compared = sum("hybrid", |r| r.compared);
    let stable = |strategy: &str| {
        let n = sum(strategy, |r| r.stable);
        format!("{n}/{compared} ({}%)", n * 100 / compared.max(1))
    };
    let calls = [sum("summarize", |r| r.calls), sum("hybrid", |r| r.calls)];
    let line = format!(
        "{window:>6}  {:>15}  {:>12}  {:>16}  {:>13}  {:>16}  {:>13}",
        calls[0],
        calls[1],
        sum("summarize", |r| r.tokens),
        sum("hybrid", |r| r.tokens),
        stable("summarize"),
        stable("hybrid"),
    );
    (line, calls)
}

/// README's sweep table: hybrid against summarize over windows.
#[test]
fn the_readme_sweep_is_the_replay_over_windows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut table = String::from(HEADER);
    for window in SWEEP_WINDOWS {
        let (line, [summarize_calls, hybrid_calls]) = sweep_line(dir.path(), window);
        assert!(hybrid_calls <= summarize_calls, "{line}");
        table.push('\n');
        table.push_str(&line);
    }
    let at = README
        .find(&format!("```\n{HEADER}"))
        .expect("README's sweep table")
        + 4;
    let len = README[at..].find("\n```").expect("the table's end");
    assert_eq!(
        &README[at..at + len],
        table,
        "README's sweep table is out of date; the replay gives:\n{table}"
    );
}

/// The sweep table's header.
const HEADER: &str = "window  summarize_calls  hybrid_calls  summarize_tokens  hybrid_tokens  summarize_stable  hybrid_stable";
