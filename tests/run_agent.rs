//! `compactor run`: an agent started through compactor in one command. A stand-in agent (a
//! Python script) records what it was given and talks to the proxy it was pointed at; the
//! tests check its environment, that its requests reach the upstream through compactor and
//! are compacted, its exit code, that a SIGTERM sent to compactor reaches it, the one-line
//! summary, `--print-env`, and that an already running compactor is used rather than a second.

mod support;

use std::path::Path;
use std::process::{Output, Stdio};

use serde_json::json;
use support::{upstream_toml, Binary, MockUpstream, Reply};

/// The stand-in agent: writes its environment to `env.json`, sends a long chat request and a
/// models request to the base URL it was given, then exits with status 7.
const AGENT: &str = r#"
import json, os, sys, urllib.request
with open("env.json", "w") as f:
    json.dump({k: v for k, v in os.environ.items() if "BASE" in k}, f)
base = os.environ["OPENAI_BASE_URL"]
messages = [{"role": "system", "content": "be brief"}]
for i in range(21):
    messages.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": f"turn {i}: " + "words " * 200})
req = urllib.request.Request(base + "/chat/completions",
    data=json.dumps({"model": "gpt-4o", "messages": messages}).encode(),
    headers={"content-type": "application/json", "authorization": "Bearer sk-run"})
urllib.request.urlopen(req).read()
urllib.request.urlopen(base + "/models").read()
sys.exit(7)
"#;

fn config(dir: &Path, mock: &MockUpstream, server: &str) -> String {
    let path = dir.join("compactor.toml");
    std::fs::write(
        &path,
        format!(
            "{server}{}[compaction]\nmax_messages = 10\n[summarizer]\nbackend = \"extractive\"\n",
            upstream_toml(&mock.url())
        ),
    )
    .expect("write config");
    path.display().to_string()
}

async fn compactor(dir: &Path, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
    command.args(args).current_dir(dir).stdin(Stdio::null());
    for (key, _) in std::env::vars() {
        if key.starts_with("COMPACTOR_") || key.contains("BASE_URL") {
            command.env_remove(key);
        }
    }
    support::within("compactor run", command.output())
        .await
        .expect("run compactor")
}

async fn provider() -> MockUpstream {
    let mock = MockUpstream::start().await;
    mock.set_handler(|r| {
        if r.path().ends_with("/models") {
            Reply::json(200, &json!({"object": "list", "data": []}))
        } else {
            Reply::json(
                200,
                &json!({"id": "c", "object": "chat.completion",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "ok"}}]}),
            )
        }
    });
    mock
}

#[tokio::test]
async fn an_agent_runs_through_a_compactor_started_for_it() {
    let mock = provider().await;
    let dir = tempfile::tempdir().expect("tempdir");
    // The configured ports are not the ones used: `run` picks free ones.
    let config = config(
        dir.path(),
        &mock,
        "[server]\nlisten = \"127.0.0.1:1\"\nadmin_listen = \"127.0.0.1:2\"\n",
    );
    let out = compactor(
        dir.path(),
        &["run", "--config", &config, "python3", "--", "-c", AGENT],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(7),
        "the agent's exit code: {stderr}"
    );

    let env: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("env.json")).expect("the agent ran"),
    )
    .expect("env.json");
    let base = env["OPENAI_BASE_URL"].as_str().expect("OPENAI_BASE_URL");
    assert!(
        base.starts_with("http://127.0.0.1:") && base.ends_with("/v1"),
        "{base}"
    );
    assert!(
        !base.starts_with("http://127.0.0.1:1/"),
        "a free port: {base}"
    );
    assert_eq!(env["OPENAI_API_BASE"].as_str(), Some(base));
    let origin = base.trim_end_matches("/v1");
    assert_eq!(
        env["ANTHROPIC_BASE_URL"].as_str(),
        Some(format!("{origin}/anthropic").as_str())
    );

    // Both requests went through compactor; the long conversation compacted on the way.
    let requests = mock.requests();
    let chat = requests
        .iter()
        .find(|r| r.path() == "/v1/chat/completions")
        .expect("the chat request reached the upstream");
    let sent: serde_json::Value = serde_json::from_slice(&chat.body).expect("JSON");
    assert!(
        sent["messages"].as_array().expect("messages").len() < 22,
        "compacted"
    );
    assert!(requests.iter().any(|r| r.path() == "/v1/models"));
    // Where the session inspector is, said first; then the summary on exit.
    let page = stderr
        .lines()
        .find_map(|l| l.split("what it does: ").nth(1))
        .unwrap_or_else(|| panic!("no page address: {stderr}"));
    assert!(
        page.starts_with("http://127.0.0.1:") && page.ends_with("/ui"),
        "{page}"
    );
    let summary = stderr
        .lines()
        .find(|l| l.starts_with("compactor: ") && l.contains(" requests, "))
        .unwrap_or_else(|| panic!("no summary line: {stderr}"));
    assert!(
        summary.starts_with("compactor: 2 requests, 1 compactions, "),
        "{summary}"
    );
    assert!(
        summary.contains("estimated input tokens forwarded ("),
        "{summary}"
    );
}

#[tokio::test]
async fn a_sigterm_sent_to_compactor_reaches_the_agent() {
    let mock = provider().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config(dir.path(), &mock, "");
    // Says it is ready on its stdout (compactor's, inherited), then waits for SIGTERM and
    // exits 0 on it (3 if it never comes).
    let agent = r#"
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
time.sleep(60)
sys.exit(3)
"#;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_compactor"))
        .args(["run", "--config", &config, "python3", "--", "-c", agent])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn compactor run");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = support::within("the agent to start", lines.next_line())
        .await
        .expect("read the agent's stdout");
    assert_eq!(line.as_deref(), Some("ready"));
    let pid = child.id().expect("pid");
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a process id");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = support::within("compactor run to exit", child.wait())
        .await
        .expect("wait");
    assert_eq!(
        status.code(),
        Some(0),
        "the agent exited on the SIGTERM passed on"
    );
}

#[tokio::test]
async fn print_env_names_what_each_agent_reads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = compactor(dir.path(), &["run", "--print-env", "claude"]).await;
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "export ANTHROPIC_BASE_URL='http://127.0.0.1:8787/anthropic'\n"
    );
    let out = compactor(dir.path(), &["run", "--print-env", "codex"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("model_providers.compactor.base_url=\"http://127.0.0.1:8787/v1\""),
        "{text}"
    );
}

#[tokio::test]
async fn a_compactor_already_running_is_used() {
    let mock = provider().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (listen, admin) = (support::closed_port(), support::closed_port());
    let config = config(
        dir.path(),
        &mock,
        &format!(
            "[server]\nlisten = \"127.0.0.1:{listen}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n"
        ),
    );
    let serving = Binary::serve(Path::new(&config), dir.path()).await;
    assert_eq!(serving.proxy.port(), listen);
    let out = compactor(
        dir.path(),
        &["run", "--config", &config, "python3", "--", "-c", AGENT],
    )
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    let env: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("env.json")).expect("the agent ran"),
    )
    .expect("env.json");
    assert_eq!(
        env["OPENAI_BASE_URL"].as_str(),
        Some(format!("http://127.0.0.1:{listen}/v1").as_str())
    );
    assert!(
        !stderr.contains("compactor: "),
        "no page or summary for a compactor run did not start: {stderr}"
    );
    assert!(mock.requests().iter().any(|r| r.path() == "/v1/models"));
}
