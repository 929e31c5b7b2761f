//! The `exec` backend against real processes: the shipped Python example, timeouts that must
//! kill a whole process group, crashes, bad output and the child's environment.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use compactor_plugin_api::{Caller, Entry, Part, Role, SummarizeError, Summarizer, SummaryRequest};
use compactor_plugin_exec::{ExecConfig, ExecSummarizer};

const SECRET: &str = "sk-exec-test-secret-0123456789";

fn request(timeout: Duration) -> SummaryRequest {
    SummaryRequest {
        in_conversation: None,
        prompt: "<task>Summarize</task>".into(),
        prior_summary: Some("The user earlier asked for a CLI.".into()),
        entries: vec![
            Entry {
                role: Role::User,
                parts: vec![Part::Text {
                    text: "Please fix the failing parser test".into(),
                }],
            },
            Entry {
                role: Role::Assistant,
                parts: vec![
                    Part::Text {
                        text: "Running the tests first.".into(),
                    },
                    Part::ToolCall {
                        name: "bash".into(),
                        arguments: r#"{"command":"cargo test"}"#.into(),
                    },
                    Part::ToolResult {
                        name: "bash".into(),
                        output: "error[E0308]: mismatched types".into(),
                        is_error: true,
                    },
                ],
            },
            Entry {
                role: Role::User,
                parts: vec![Part::Text {
                    text: "Also update the changelog".into(),
                }],
            },
        ],
        read_files: vec!["src/parser.rs".into()],
        modified_files: vec!["CHANGELOG.md".into()],
        instructions: Some("focus on the parser".into()),
        compaction_num: 2,
        model: Some("gpt-4o".into()),
        max_output_tokens: 1000,
        timeout,
        caller: Caller {
            upstream_base_url: "https://api.openai.com".into(),
            api_prefix: "/v1".into(),
            credentials: vec![
                ("authorization".into(), format!("Bearer {SECRET}")),
                ("x-api-key".into(), SECRET.into()),
            ],
            ..Caller::default()
        },
    }
}

fn sh(script: &str) -> ExecSummarizer {
    ExecSummarizer::new(ExecConfig::new("/bin/sh", vec!["-c".into(), script.into()]))
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/summarize.py")
}

/// Whether `pid` is gone: no such process, or a zombie (dead, waiting for its new parent).
fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

/// Polls until every pid is gone (the kernel delivers SIGKILL asynchronously), at most 5 s.
async fn assert_all_gone(pids: &[i32]) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let alive: Vec<i32> = pids.iter().copied().filter(|p| !process_gone(*p)).collect();
        if alive.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "still running: {alive:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn read_pids(path: &Path) -> Vec<i32> {
    let text = std::fs::read_to_string(path).expect("the script wrote its pids");
    let pids: Vec<i32> = text
        .split_whitespace()
        .map(|p| p.parse().expect("pid"))
        .collect();
    assert_eq!(pids.len(), 2, "{text}");
    pids
}

#[tokio::test]
async fn the_python_example_answers_a_summary() {
    let plugin = ExecSummarizer::new(ExecConfig::new(
        "python3",
        vec![example().display().to_string()],
    ));
    let summary = plugin
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect("the example answers");
    let text = summary.text;
    assert!(text.contains("compaction #2"), "{text}");
    assert!(
        text.contains("1. Please fix the failing parser test"),
        "{text}"
    );
    assert!(text.contains("2. Also update the changelog"), "{text}");
    assert!(
        text.contains("src/parser.rs") && text.contains("CHANGELOG.md"),
        "{text}"
    );
    assert!(text.contains("Focus: focus on the parser"), "{text}");
    assert!(text.contains("The user earlier asked for a CLI."), "{text}");
    assert!(!text.contains(SECRET), "{text}");
}

#[tokio::test]
async fn the_program_receives_the_versioned_request_on_stdin() {
    // The program echoes its stdin back as the summary.
    let plugin = ExecSummarizer::new(ExecConfig::new(
        "python3",
        vec![
            "-c".into(),
            "import json,sys; print(json.dumps({'summary': sys.stdin.read()}))".into(),
        ],
    ));
    let summary = plugin
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect("answers");
    let wire: serde_json::Value = serde_json::from_str(&summary.text).expect("stdin was JSON");
    assert_eq!(wire["version"], 1);
    assert_eq!(wire["prompt"], "<task>Summarize</task>");
    assert_eq!(wire["compaction_num"], 2);
    assert_eq!(wire["max_output_tokens"], 1000);
    assert_eq!(wire["timeout"], 20.0);
    assert_eq!(wire["instructions"], "focus on the parser");
    assert_eq!(wire["entries"][1]["parts"][2]["type"], "tool_result");
    assert_eq!(wire["entries"][1]["parts"][2]["is_error"], true);
    assert!(wire.get("caller").is_none());
    assert!(!summary.text.contains(SECRET));
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pid_file = dir.path().join("pids");
    // The grandchild keeps stdout open, so only killing the group ends the exchange.
    let script = format!(
        "sleep 300 & echo \"$$ $!\" > '{}'; wait",
        pid_file.display()
    );
    let plugin = sh(&script);
    let started = Instant::now();
    let err = plugin
        .summarize(&request(Duration::from_millis(1500)))
        .await
        .expect_err("times out");
    assert!(matches!(err, SummarizeError::Timeout(_)), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_all_gone(&read_pids(&pid_file)).await;
}

#[tokio::test]
async fn dropping_the_future_kills_the_whole_process_group() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pid_file = dir.path().join("pids");
    let script = format!(
        "sleep 300 & echo \"$$ $!\" > '{p}.tmp'; mv '{p}.tmp' '{p}'; wait",
        p = pid_file.display()
    );
    let plugin = sh(&script);
    let request = request(Duration::from_secs(300));
    let mut call = plugin.summarize(&request);
    // Drive the call until the script has written its pids, then drop it (as an outer timeout
    // would).
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::select! {
            r = &mut call => panic!("finished early: {r:?}"),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if pid_file.exists() {
            break;
        }
        assert!(Instant::now() < until, "script never started");
    }
    drop(call);
    assert_all_gone(&read_pids(&pid_file)).await;
}

#[tokio::test]
async fn a_crash_is_a_status_error_with_its_exit_code_and_stderr() {
    let err = sh("cat >/dev/null; echo 'model exploded' >&2; exit 3")
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect_err("crashes");
    match err {
        SummarizeError::Status { status, message } => {
            assert_eq!(status, 3);
            assert!(message.contains("model exploded"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn garbage_output_is_invalid() {
    let err = sh("cat >/dev/null; echo 'here is your summary: lol'")
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect_err("garbage");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
    let err = sh("echo '{\"text\": \"wrong field\"}'")
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect_err("wrong field");
    assert!(matches!(err, SummarizeError::InvalidOutput(_)), "{err:?}");
}

#[tokio::test]
async fn blank_output_is_blank() {
    // printf's %s leaves the JSON escapes alone: the summary is two spaces, a tab, a newline.
    let err = sh("cat >/dev/null; printf '%s\\n' '{\"summary\": \"  \\t \\n \"}'")
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect_err("blank");
    assert!(matches!(err, SummarizeError::Blank), "{err:?}");
}

#[tokio::test]
async fn oversized_stdout_is_too_large_and_stops_the_program() {
    let mut config = ExecConfig::new("/bin/sh", vec!["-c".into(), "yes".into()]);
    config.max_stdout_bytes = 64 * 1024;
    let started = Instant::now();
    let err = ExecSummarizer::new(config)
        .summarize(&request(Duration::from_secs(30)))
        .await
        .expect_err("too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, limit: 65536 } if what == "stdout"),
        "{err:?}"
    );
    assert_eq!(err.kind(), "too_large");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn a_summary_over_its_bound_is_too_large() {
    // 3,000 bytes of summary: within the stdout bound, over the summary bound.
    let script =
        r#"cat >/dev/null; printf '{"summary": "%s"}' "$(yes s | head -c 6000 | tr -d '\n')""#;
    let mut config = ExecConfig::new("/bin/sh", vec!["-c".into(), script.into()]);
    config.max_summary_bytes = 2000;
    let err = ExecSummarizer::new(config.clone())
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect_err("too large");
    assert!(
        matches!(&err, SummarizeError::TooLarge { what, limit: 2000 } if what == "summary"),
        "{err:?}"
    );
    config.max_summary_bytes = 3000;
    let summary = ExecSummarizer::new(config)
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect("at the bound");
    assert_eq!(summary.text.len(), 3000);
}

#[tokio::test]
async fn a_program_that_ignores_a_large_stdin_still_answers() {
    let mut request = request(Duration::from_secs(20));
    request.prompt = "x".repeat(4 * 1024 * 1024);
    let summary = sh("echo '{\"summary\": \"did not read\"}'")
        .summarize(&request)
        .await
        .expect("answers");
    assert_eq!(summary.text, "did not read");
}

#[tokio::test]
async fn the_environment_holds_path_and_configured_variables_only() {
    // `sh` puts its environment, `NAME=value` entries joined by `|`, into the summary (the values here
    // hold no characters that need JSON escaping; a leaked credential would not either).
    let script = r#"cat >/dev/null; printf '{"summary": "%s"}' "$(env | tr '\n' '|')""#;
    let mut config = ExecConfig::new("/bin/sh", vec!["-c".into(), script.into()]);
    config.env = BTreeMap::from([("PLUGIN_MODE".to_owned(), "fast".to_owned())]);
    let summary = ExecSummarizer::new(config)
        .summarize(&request(Duration::from_secs(20)))
        .await
        .expect("answers");
    assert!(!summary.text.contains(SECRET), "{}", summary.text);
    let env: BTreeMap<&str, &str> = summary
        .text
        .split('|')
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_once('='))
        .collect();
    assert_eq!(env.get("PLUGIN_MODE").copied(), Some("fast"), "{env:?}");
    assert_eq!(
        env.get("PATH").map(|p| p.to_string()),
        std::env::var("PATH").ok(),
        "{env:?}"
    );
    // The shell itself exports PWD; nothing else may appear.
    let keys: BTreeSet<&str> = env.keys().copied().filter(|k| *k != "PWD").collect();
    assert_eq!(keys, BTreeSet::from(["PATH", "PLUGIN_MODE"]));
    assert!(
        std::env::vars().any(|(k, _)| k != "PATH" && k != "PWD" && !env.contains_key(k.as_str())),
        "the test process has variables the child must not see"
    );
}

#[tokio::test]
async fn a_missing_program_is_a_config_error() {
    let err = ExecSummarizer::new(ExecConfig::new("/no/such/program", vec![]))
        .summarize(&request(Duration::from_secs(5)))
        .await
        .expect_err("missing");
    assert_eq!(err.kind(), "config");
}
