//! The real `compactor` binary started as a child process (`serve --config PATH`), its
//! listener addresses read from its log, its stderr drained so it never blocks.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;
use tokio::task::JoinHandle;

use super::within;

/// A running `compactor serve`.
pub struct Binary {
    /// The child (killed on drop).
    pub child: Child,
    /// Its process id.
    pub pid: u32,
    /// Proxy listener address from the log.
    pub proxy: SocketAddr,
    /// Admin listener address from the log.
    pub admin: SocketAddr,
    /// Log lines up to the listening lines.
    pub log: Vec<String>,
    /// The rest of the log, once the process ends.
    pub drain: JoinHandle<Vec<String>>,
}

impl Binary {
    /// Runs `compactor serve --config <config>` in `dir` with `RUST_LOG=info` and no
    /// inherited `COMPACTOR_*` variables; returns once both listeners are logged.
    pub async fn serve(config: &Path, dir: &Path) -> Binary {
        Binary::serve_with_log(config, dir, "info").await
    }

    /// [`Binary::serve`] with another `RUST_LOG` filter.
    pub async fn serve_with_log(config: &Path, dir: &Path, filter: &str) -> Binary {
        Binary::serve_with_env(config, dir, filter, &[]).await
    }

    /// [`Binary::serve_with_log`] with these `COMPACTOR_*` variables set.
    pub async fn serve_with_env(
        config: &Path,
        dir: &Path,
        filter: &str,
        env: &[(&str, &str)],
    ) -> Binary {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
        command
            .arg("serve")
            .arg("--config")
            .arg(config)
            .current_dir(dir)
            .env("RUST_LOG", filter)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (key, _) in std::env::vars() {
            if key.starts_with("COMPACTOR_") {
                command.env_remove(key);
            }
        }
        command.envs(env.iter().copied());
        let mut child = command.spawn().expect("spawn compactor");
        let pid = child.id().expect("pid");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let (mut proxy, mut admin) = (None, None);
        let mut log = Vec::new();
        within("listening log lines", async {
            while proxy.is_none() || admin.is_none() {
                let Some(line) = lines.next_line().await.expect("read stderr") else {
                    panic!("compactor exited before listening:\n{}", log.join("\n"));
                };
                let line = strip_ansi(&line);
                if line.contains("listening") {
                    if let Some(addr) = addr_in(&line) {
                        if line.contains("admin") {
                            admin = Some(addr);
                        } else {
                            proxy = Some(addr);
                        }
                    }
                }
                log.push(line);
            }
        })
        .await;
        let drain = tokio::spawn(async move {
            let mut rest = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                rest.push(strip_ansi(&line));
            }
            rest
        });
        Binary {
            child,
            pid,
            proxy: proxy.expect("proxy addr"),
            admin: admin.expect("admin addr"),
            log,
            drain,
        }
    }

    /// Sends a signal (`TERM`, `HUP`, ...) with `kill`.
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {} failed", self.pid);
    }
}

/// Strips ANSI colour sequences from a log line.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The first socket address in a log line.
fn addr_in(line: &str) -> Option<SocketAddr> {
    line.split(|c: char| c.is_whitespace() || c == '=' || c == '"' || c == ',' || c == '}')
        .find_map(|token| token.parse().ok())
}
