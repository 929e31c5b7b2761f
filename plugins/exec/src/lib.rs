//! The `exec` summarizer: runs any program that speaks a small JSON protocol.
//!
//! Per compaction the program is started afresh with the configured arguments, in its own
//! process group, with a cleared environment holding only `PATH` and the configured variables
//! (so the caller's credentials can never leak into it). The request goes to its stdin as one
//! JSON object (`{"version": 1, ...}`, see [`request_json`] and `plugins/README.md`); the
//! program answers `{"summary": "..."}` on stdout and exits 0.
//!
//! Bounds: stdout is read up to [`ExecConfig::max_stdout_bytes`] (the summary bound plus room
//! for the JSON around it) and the program is killed as soon as it writes more; the summary in
//! it may take at most [`ExecConfig::max_summary_bytes`]; either excess is
//! [`SummarizeError::TooLarge`]. Stderr is kept up to [`ExecConfig::max_stderr_bytes`] (and
//! logged at `warn`; stdout never is). When the request's
//! timeout passes, or the future is dropped, the whole process group is killed with `SIGKILL`
//! and the program is reaped; leftovers in the group are killed after a normal exit too.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};

use rustix::process::{kill_process_group, Pid, Signal};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use compactor_plugin_api::{
    BoxFuture, InvalidSetting, SummarizeError, Summarizer, Summary, SummaryRequest,
    DEFAULT_MAX_SUMMARY_BYTES, SUMMARY_ENVELOPE_BYTES,
};

/// The version of the JSON protocol written to the program's stdin.
pub const PROTOCOL_VERSION: u32 = 1;
/// Default bound of the program's stdout: the default summary bound plus
/// [`SUMMARY_ENVELOPE_BYTES`] for `{"summary": ...}` and escapes.
pub const DEFAULT_MAX_STDOUT_BYTES: usize = DEFAULT_MAX_SUMMARY_BYTES + SUMMARY_ENVELOPE_BYTES;
/// Default amount of the program's stderr kept for the logs.
pub const DEFAULT_MAX_STDERR_BYTES: usize = 4 * 1024;
/// Longest stderr excerpt put into a [`SummarizeError::Status`] message.
const MAX_MESSAGE_CHARS: usize = 300;

/// Settings of one `exec` backend. `Debug` prints environment names, never values.
#[derive(Clone)]
pub struct ExecConfig {
    /// The program (a path, or a name looked up in `PATH`).
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The only variables it gets besides `PATH` (these win over `PATH` too).
    pub env: BTreeMap<String, String>,
    /// Stdout larger than this fails the summary as [`SummarizeError::TooLarge`]; the program
    /// is killed once it has written one byte more, and the rest is never read.
    pub max_stdout_bytes: usize,
    /// A `summary` longer than this (in bytes) fails as [`SummarizeError::TooLarge`].
    pub max_summary_bytes: usize,
    /// Stderr beyond this is read and discarded.
    pub max_stderr_bytes: usize,
}

impl ExecConfig {
    /// A configuration with default bounds and no extra environment.
    pub fn new(command: impl Into<String>, args: Vec<String>) -> ExecConfig {
        ExecConfig {
            command: command.into(),
            args,
            env: BTreeMap::new(),
            max_stdout_bytes: DEFAULT_MAX_STDOUT_BYTES,
            max_summary_bytes: DEFAULT_MAX_SUMMARY_BYTES,
            max_stderr_bytes: DEFAULT_MAX_STDERR_BYTES,
        }
    }
}

impl fmt::Debug for ExecConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecConfig")
            .field("command", &self.command)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("max_stdout_bytes", &self.max_stdout_bytes)
            .field("max_summary_bytes", &self.max_summary_bytes)
            .field("max_stderr_bytes", &self.max_stderr_bytes)
            .finish()
    }
}

/// `[summarizer.exec]` of compactor's configuration file: the program and what it gets,
/// with their validation. The app builds the backend with [`ExecSettings::config`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecSettings {
    /// The program to run; required when `exec` is used.
    pub command: Option<String>,
    /// Its arguments.
    pub args: Vec<String>,
    /// The only environment it gets besides `PATH`.
    pub env: BTreeMap<String, String>,
}

impl ExecSettings {
    /// Whether the settings can make a backend: a command that names an existing file (with
    /// a `/`) or a program on `PATH`, and valid variable names.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let command = self.command()?;
        if !program_exists(command) {
            return Err(InvalidSetting::new(
                "command",
                format!("`{command}` is not an existing file or a program on PATH"),
            ));
        }
        if let Some(bad) = self
            .env
            .keys()
            .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        {
            return Err(InvalidSetting::new(
                "env",
                format!("`{bad}` is not a valid variable name"),
            ));
        }
        Ok(())
    }

    /// The backend's configuration, a summary bounded at `max_summary_bytes` (and stdout at
    /// that plus the JSON around it).
    pub fn config(&self, max_summary_bytes: usize) -> Result<ExecConfig, InvalidSetting> {
        let mut exec = ExecConfig::new(self.command()?, self.args.clone());
        exec.env = self.env.clone();
        exec.max_summary_bytes = max_summary_bytes;
        exec.max_stdout_bytes = max_summary_bytes.saturating_add(SUMMARY_ENVELOPE_BYTES);
        Ok(exec)
    }

    fn command(&self) -> Result<&str, InvalidSetting> {
        self.command
            .as_deref()
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| {
                InvalidSetting::new("command", "required when the `exec` backend is used")
            })
    }
}

/// Whether `command` names an existing file (when it holds a `/`) or a file on `PATH`.
fn program_exists(command: &str) -> bool {
    if command.contains('/') {
        return std::path::Path::new(command).is_file();
    }
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join(command).is_file()))
        .unwrap_or(false)
}

/// The `exec` backend.
#[derive(Debug, Clone)]
pub struct ExecSummarizer {
    config: ExecConfig,
}

impl ExecSummarizer {
    /// A backend running `config.command`.
    pub fn new(config: ExecConfig) -> ExecSummarizer {
        ExecSummarizer { config }
    }

    async fn run(&self, request: &SummaryRequest) -> Result<Summary, SummarizeError> {
        let input = request_json(request)?;
        let mut command = Command::new(&self.config.command);
        command
            .args(&self.config.args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(path) = std::env::var_os("PATH") {
            command.env("PATH", path);
        }
        command.envs(&self.config.env);
        let mut child = command.spawn().map_err(|e| {
            SummarizeError::Config(format!("cannot start `{}`: {e}", self.config.command))
        })?;
        // Armed from here on: whatever happens (including this future being dropped by an
        // outer timeout), the group is killed.
        let mut group = GroupKiller(child.id().and_then(|id| Pid::from_raw(id as i32)));

        let mut stderr = Vec::new();
        let outcome = tokio::time::timeout(
            request.timeout,
            exchange(
                &mut child,
                &input,
                &mut stderr,
                self.config.max_stdout_bytes,
                self.config.max_stderr_bytes,
            ),
        )
        .await;
        // Whatever happened, nothing the program started outlives the request.
        group.kill();
        let exchanged = outcome.unwrap_or(Err(SummarizeError::Timeout(request.timeout)));
        let result = match exchanged {
            Ok((status, stdout)) => {
                interpret(status, &stdout, &stderr, self.config.max_summary_bytes)
            }
            Err(e) => {
                // Reap the program itself (the group kill above reached it too).
                let _ = child.start_kill();
                let _ = child.wait().await;
                Err(e)
            }
        };
        if !stderr.is_empty() {
            tracing::warn!(
                backend = "exec",
                command = %self.config.command,
                stderr = %String::from_utf8_lossy(&stderr),
                "summarizer program wrote to stderr"
            );
        }
        result
    }
}

impl Summarizer for ExecSummarizer {
    fn name(&self) -> &str {
        "exec"
    }

    fn summarize<'a>(
        &'a self,
        request: &'a SummaryRequest,
    ) -> BoxFuture<'a, Result<Summary, SummarizeError>> {
        Box::pin(self.run(request))
    }
}

/// The protocol's request object: the version, then every serialisable field of the request
/// (the caller, with its credentials, is never serialised).
#[derive(Serialize)]
struct WireRequest<'a> {
    version: u32,
    #[serde(flatten)]
    request: &'a SummaryRequest,
}

/// The bytes written to the program's stdin: `{"version": 1, "prompt": ..., ...}` and a newline.
pub fn request_json(request: &SummaryRequest) -> Result<Vec<u8>, SummarizeError> {
    let mut bytes = serde_json::to_vec(&WireRequest {
        version: PROTOCOL_VERSION,
        request,
    })
    .map_err(|e| SummarizeError::Config(format!("cannot encode request: {e}")))?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The program's answer on stdout.
#[derive(serde::Deserialize)]
struct WireResponse {
    summary: Option<serde_json::Value>,
}

/// Kills a process group when told to, or when dropped.
struct GroupKiller(Option<Pid>);

impl GroupKiller {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // ESRCH (the group is already empty) is the common, harmless case.
            let _ = kill_process_group(pgid, Signal::KILL);
        }
    }
}

impl Drop for GroupKiller {
    fn drop(&mut self) {
        self.kill();
    }
}

enum Stop {
    Io(io::Error),
    TooLarge,
}

/// Feeds stdin, drains stdout (bounded) and stderr (head kept), then reaps the program.
async fn exchange(
    child: &mut Child,
    input: &[u8],
    stderr_head: &mut Vec<u8>,
    max_stdout: usize,
    max_stderr: usize,
) -> Result<(ExitStatus, Vec<u8>), SummarizeError> {
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let write = async {
        if let Some(mut stdin) = stdin {
            match stdin.write_all(input).await {
                // A program may answer without reading its input.
                Err(e) if e.kind() != io::ErrorKind::BrokenPipe => return Err(Stop::Io(e)),
                _ => {}
            }
            // Dropping stdin closes it: the program sees end of input.
        }
        Ok(())
    };
    let read_out = async {
        let mut out = Vec::new();
        if let Some(stdout) = stdout {
            let limit = max_stdout as u64 + 1;
            stdout
                .take(limit)
                .read_to_end(&mut out)
                .await
                .map_err(Stop::Io)?;
            if out.len() > max_stdout {
                return Err(Stop::TooLarge);
            }
        }
        Ok(out)
    };
    let read_err = async {
        if let Some(stderr) = stderr {
            read_head(stderr, stderr_head, max_stderr)
                .await
                .map_err(Stop::Io)?;
        }
        Ok(())
    };
    let ((), stdout, ()) = tokio::try_join!(write, read_out, read_err).map_err(|e| match e {
        Stop::Io(e) => SummarizeError::Transport(format!("talking to the program: {e}")),
        Stop::TooLarge => SummarizeError::TooLarge {
            what: "stdout".into(),
            limit: max_stdout,
        },
    })?;
    let status = child
        .wait()
        .await
        .map_err(|e| SummarizeError::Transport(format!("waiting for the program: {e}")))?;
    Ok((status, stdout))
}

/// Reads `reader` to its end, keeping only the first `max` bytes in `head`.
async fn read_head(
    mut reader: impl AsyncRead + Unpin,
    head: &mut Vec<u8>,
    max: usize,
) -> io::Result<()> {
    let mut buf = [0u8; 4096];
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        let keep = n.min(max.saturating_sub(head.len()));
        head.extend_from_slice(&buf[..keep]);
    }
}

/// Maps the program's exit status and output onto the result; a summary may take
/// `max_summary` bytes.
fn interpret(
    status: ExitStatus,
    stdout: &[u8],
    stderr: &[u8],
    max_summary: usize,
) -> Result<Summary, SummarizeError> {
    if !status.success() {
        let (code, what) = match (status.code(), status.signal()) {
            (Some(code), _) => (code, format!("exited with status {code}")),
            (None, Some(sig)) => (128 + sig, format!("killed by signal {sig}")),
            (None, None) => (255, "ended abnormally".to_owned()),
        };
        let excerpt = excerpt(stderr);
        let message = if excerpt.is_empty() {
            what
        } else {
            format!("{what}: {excerpt}")
        };
        return Err(SummarizeError::Status {
            status: u16::try_from(code).unwrap_or(u16::MAX),
            message,
        });
    }
    let response: WireResponse = serde_json::from_slice(stdout)
        .map_err(|e| SummarizeError::InvalidOutput(format!("stdout is not a JSON object: {e}")))?;
    match response.summary {
        Some(serde_json::Value::String(text)) => Summary::bounded(text, max_summary),
        Some(serde_json::Value::Null) | None => Err(SummarizeError::InvalidOutput(
            "stdout JSON has no `summary`".into(),
        )),
        Some(_) => Err(SummarizeError::InvalidOutput(
            "`summary` is not a string".into(),
        )),
    }
}

/// The start of stderr on one line, bounded.
fn excerpt(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((i, _)) => format!("{}…", &one_line[..i]),
        None => one_line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_need_an_existing_command_and_valid_names() {
        let missing = ExecSettings::default();
        assert_eq!(missing.validate().map_err(|e| e.key), Err("command"));
        let absent = ExecSettings {
            command: Some("no-such-program-7731".into()),
            ..ExecSettings::default()
        };
        assert_eq!(absent.validate().map_err(|e| e.key), Err("command"));
        let sh = ExecSettings {
            command: Some("sh".into()),
            args: vec!["-c".into(), "true".into()],
            env: BTreeMap::from([("KEY".into(), "v".into())]),
        };
        assert_eq!(sh.validate(), Ok(()));
        let bad_env = ExecSettings {
            env: BTreeMap::from([("A=B".into(), "v".into())]),
            ..sh.clone()
        };
        assert_eq!(bad_env.validate().map_err(|e| e.key), Err("env"));
        let config = sh.config(100).expect("config");
        assert_eq!(config.command, "sh");
        assert_eq!(config.max_stdout_bytes, 100 + SUMMARY_ENVELOPE_BYTES);
        assert_eq!(config.env.get("KEY").map(String::as_str), Some("v"));
    }
    use compactor_plugin_api::{Caller, Entry, Part, Role};
    use std::time::Duration;

    #[test]
    fn the_wire_request_is_versioned_and_has_no_credentials() {
        let request = SummaryRequest {
            in_conversation: None,
            prompt: "P".into(),
            prior_summary: None,
            entries: vec![Entry {
                role: Role::Assistant,
                parts: vec![Part::ToolCall {
                    name: "bash".into(),
                    arguments: "{}".into(),
                }],
            }],
            read_files: vec!["a.rs".into()],
            modified_files: vec![],
            instructions: None,
            compaction_num: 2,
            model: Some("m".into()),
            max_output_tokens: 100,
            timeout: Duration::from_millis(1500),
            caller: Caller {
                upstream_base_url: "https://up".into(),
                api_prefix: "/v1".into(),
                credentials: vec![("authorization".into(), "Bearer sk-xyz".into())],
                ..Caller::default()
            },
        };
        let bytes = request_json(&request).expect("json");
        let text = String::from_utf8(bytes).expect("utf8");
        assert!(
            !text.contains("sk-xyz") && !text.contains("https://up"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&text).expect("parse");
        assert_eq!(v["version"], 1);
        assert_eq!(v["timeout"], 1.5);
        assert_eq!(v["entries"][0]["parts"][0]["type"], "tool_call");
        assert_eq!(v["entries"][0]["role"], "assistant");
    }

    #[test]
    fn exit_statuses_map_to_status_errors() {
        let err = interpret(ExitStatus::from_raw(3 << 8), b"", b"boom\n  bad", 100)
            .expect_err("non-zero");
        match err {
            SummarizeError::Status { status, message } => {
                assert_eq!(status, 3);
                assert_eq!(message, "exited with status 3: boom bad");
            }
            other => panic!("{other:?}"),
        }
        let err = interpret(ExitStatus::from_raw(9), b"", b"", 100).expect_err("signal");
        assert!(matches!(err, SummarizeError::Status { status: 137, .. }));
        assert!(matches!(
            interpret(ExitStatus::from_raw(0), br#"{"summary": 3}"#, b"", 100),
            Err(SummarizeError::InvalidOutput(_))
        ));
        assert!(matches!(
            interpret(ExitStatus::from_raw(0), br#"{"summary": " "}"#, b"", 100),
            Err(SummarizeError::Blank)
        ));
        assert!(matches!(
            interpret(ExitStatus::from_raw(0), br#"{"summary": "12345"}"#, b"", 4),
            Err(SummarizeError::TooLarge { limit: 4, .. })
        ));
        assert_eq!(
            interpret(ExitStatus::from_raw(0), br#"{"summary": "1234"}"#, b"", 4)
                .map(|s| s.text)
                .ok(),
            Some("1234".into())
        );
    }
}
