//! `compactor run <agent> [-- args]`: an agent through compactor in one command.
//!
//! It uses the compactor already answering at the configured admin address, or starts one in
//! this process on free local ports (with an `/anthropic` route to Anthropic's API and a
//! `/gemini` route to Google's when the configuration has none, so every agent below has a
//! way through). The agent is then started in the foreground, with the terminal, pointed at
//! compactor the way it needs ([`Agent::settings`]): Claude Code by `ANTHROPIC_BASE_URL`
//! through the Anthropic route; Codex by a custom Responses provider passed as `-c` overrides
//! (its built-in provider would try a WebSocket first); opencode by its providers' `baseURL` in
//! `OPENCODE_CONFIG_CONTENT`; Gemini CLI by `GOOGLE_GEMINI_BASE_URL` through the Gemini route;
//! aider and any other command by
//! `OPENAI_BASE_URL`, `OPENAI_API_BASE` and `ANTHROPIC_BASE_URL`.
//!
//! Ctrl-C reaches the agent (the terminal sends it to the whole foreground group; compactor
//! ignores it while the agent runs), a `SIGTERM` or `SIGHUP` sent to compactor is passed on to
//! the agent, and the agent's exit code is returned. When compactor was started here, one line
//! on exit says what it did: requests, compactions, tokens received and forwarded, and the
//! provider's bill where the model is priced.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::app::App;
use crate::config::{Config, RouteCompaction, RouteConfig};
use crate::error::Error;
use crate::server::Server;

/// Anthropic's API, for the route `run` adds when the configuration has no `/anthropic`.
const ANTHROPIC_API: &str = "https://api.anthropic.com";
/// Google's Gemini API, for the route `run` adds when the configuration has no `/gemini`.
const GEMINI_API: &str = "https://generativelanguage.googleapis.com";

/// The output cap `run` gives opencode (its own default is 32,000): room for a long answer
/// that leaves most of a 32k-token window to the conversation.
pub const OPENCODE_OUTPUT_TOKENS: usize = 8_192;

/// What `run` knows about an agent's command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agent {
    /// Claude Code (`claude`).
    Claude,
    /// Codex CLI (`codex`).
    Codex,
    /// opencode (`opencode`).
    Opencode,
    /// Gemini CLI (`gemini`).
    Gemini,
    /// aider, SDK scripts, anything else: the OpenAI and Anthropic base URL variables.
    Other,
}

/// How an agent is pointed at compactor: variables to set and arguments to put first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// Environment variables.
    pub env: Vec<(String, String)>,
    /// Environment variables set only where the user's environment has none.
    pub defaults: Vec<(String, String)>,
    /// Arguments before the user's own.
    pub args: Vec<String>,
}

impl Agent {
    /// The agent a command runs, by its file name.
    pub fn of(command: &Path) -> Agent {
        match command.file_name().and_then(|n| n.to_str()) {
            Some("claude") => Agent::Claude,
            Some("codex") => Agent::Codex,
            Some("opencode") => Agent::Opencode,
            Some("gemini") => Agent::Gemini,
            _ => Agent::Other,
        }
    }

    /// How this agent reaches compactor at `base` (`http://host:port`).
    pub fn settings(self, base: &str) -> Settings {
        let env = |pairs: &[(&str, String)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect()
        };
        let openai = format!("{base}/v1");
        let anthropic = format!("{base}/anthropic");
        match self {
            Agent::Claude => Settings {
                env: env(&[("ANTHROPIC_BASE_URL", anthropic)]),
                defaults: Vec::new(),
                args: Vec::new(),
            },
            // A provider of its own over HTTP: Codex's built-in one opens a WebSocket first.
            // The key is the one Codex users already have (OPENAI_API_KEY).
            Agent::Codex => Settings {
                env: Vec::new(),
                defaults: Vec::new(),
                args: [
                    "model_provider=\"compactor\"".to_string(),
                    "model_providers.compactor.name=\"compactor\"".to_string(),
                    format!("model_providers.compactor.base_url=\"{openai}\""),
                    "model_providers.compactor.wire_api=\"responses\"".to_string(),
                    "model_providers.compactor.env_key=\"OPENAI_API_KEY\"".to_string(),
                ]
                .into_iter()
                .flat_map(|kv| ["-c".to_string(), kv])
                .collect(),
            },
            // opencode asks for 32,000 output tokens unless told otherwise, and the provider
            // counts them against the window: in a small window that leaves little room for the
            // conversation, and compaction would run on every request. A cap the user set is
            // kept ([`agent`] never overrides a variable already set).
            Agent::Opencode => Settings {
                env: env(&[(
                    "OPENCODE_CONFIG_CONTENT",
                    serde_json::json!({"provider": {
                        "openai": {"options": {"baseURL": openai}},
                        "anthropic": {"options": {"baseURL": format!("{anthropic}/v1")}},
                    }})
                    .to_string(),
                )]),
                defaults: env(&[(
                    "OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX",
                    OPENCODE_OUTPUT_TOKENS.to_string(),
                )]),
                args: Vec::new(),
            },
            Agent::Gemini => Settings {
                env: env(&[("GOOGLE_GEMINI_BASE_URL", format!("{base}/gemini"))]),
                defaults: Vec::new(),
                args: Vec::new(),
            },
            Agent::Other => Settings {
                env: env(&[
                    ("OPENAI_BASE_URL", openai.clone()),
                    ("OPENAI_API_BASE", openai),
                    ("ANTHROPIC_BASE_URL", anthropic),
                ]),
                defaults: Vec::new(),
                args: Vec::new(),
            },
        }
    }
}

/// `settings` as shell lines: `export` for each variable, and the arguments to add.
pub fn print_env(settings: &Settings) -> String {
    let mut out = String::new();
    for (k, v) in &settings.env {
        out.push_str(&format!("export {k}={}\n", shell_quote(v)));
    }
    for (k, v) in &settings.defaults {
        out.push_str(&format!(
            "export {k}=\"${{{k}:-{}}}\"\n",
            v.replace('"', "")
        ));
    }
    if !settings.args.is_empty() {
        let args: Vec<String> = settings.args.iter().map(|a| shell_quote(a)).collect();
        out.push_str(&format!("# and pass first: {}\n", args.join(" ")));
    }
    out
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `config` as `run` starts it: both listeners on free local ports, and the routes every
/// agent needs added when missing.
pub fn local(mut config: Config) -> Config {
    config.server.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.server.admin_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    for (prefix, base_url) in [("/anthropic", ANTHROPIC_API), ("/gemini", GEMINI_API)] {
        if !config.routes.iter().any(|r| r.prefix == prefix) {
            config.routes.push(RouteConfig {
                prefix: prefix.to_string(),
                base_url: base_url.to_string(),
                strip_prefix: true,
                compaction: RouteCompaction::default(),
            });
        }
    }
    config
}

/// The compactor `run` talks to: one already serving, or one started here.
pub enum Proxy {
    /// Already answering at the configured address.
    Running(SocketAddr),
    /// Started by `run`, in this process.
    Started {
        /// Where it listens.
        addr: SocketAddr,
        /// Its admin listener (the session inspector page).
        admin: SocketAddr,
        /// Its state (for the summary on exit).
        app: Arc<App>,
        /// Tells it to shut down.
        stop: tokio::sync::oneshot::Sender<()>,
        /// It, serving.
        serving: tokio::task::JoinHandle<Result<(), Error>>,
    },
}

impl Proxy {
    /// The base URL agents are given.
    pub fn base(&self) -> String {
        match self {
            Proxy::Running(addr) | Proxy::Started { addr, .. } => format!("http://{addr}"),
        }
    }

    /// The session inspector page of a compactor started here.
    pub fn page(&self) -> Option<String> {
        match self {
            Proxy::Running(_) => None,
            Proxy::Started { admin, .. } => Some(format!("http://{admin}/ui")),
        }
    }

    /// The compactor at `config`'s addresses if its admin listener answers `/livez`, else one
    /// started here on free ports.
    pub async fn find_or_start(config: Config) -> Result<Proxy, Error> {
        if answers_livez(config.server.admin_listen).await {
            return Ok(Proxy::Running(config.server.listen));
        }
        let server = Server::bind(local(config)).await?;
        let addr = server.proxy_addr();
        let admin = server.admin_addr();
        let app = server.app();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(server.run(async move {
            let _ = stopped.await;
        }));
        Ok(Proxy::Started {
            addr,
            admin,
            app,
            stop,
            serving,
        })
    }

    /// Shuts a compactor started here down and returns its one-line summary.
    pub async fn finish(self) -> Option<String> {
        let Proxy::Started {
            app, stop, serving, ..
        } = self
        else {
            return None;
        };
        let _ = stop.send(());
        let _ = serving.await;
        Some(app.metrics.run_summary())
    }
}

/// Whether something answers `GET /livez` with 200 at `addr` within a second.
async fn answers_livez(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream
            .write_all(b"GET /livez HTTP/1.1\r\nHost: compactor\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1.1 200"))
    };
    tokio::time::timeout(Duration::from_secs(1), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Runs `command` with `args` pointed at `base` in the foreground; its exit code (128 plus
/// the signal's number when a signal ended it).
pub async fn agent(command: &OsString, args: &[OsString], base: &str) -> Result<i32, Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let settings = Agent::of(Path::new(command)).settings(base);
    let unset = settings
        .defaults
        .iter()
        .filter(|(k, _)| std::env::var_os(k).is_none());
    let mut child = tokio::process::Command::new(command)
        .args(&settings.args)
        .args(args)
        .envs(settings.env.iter().chain(unset).map(|(k, v)| (k, v)))
        .spawn()
        .map_err(|e| Error::Agent(format!("{}: {e}", command.to_string_lossy())))?;
    let pid = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(id as i32));
    // The terminal's Ctrl-C reaches the agent itself; compactor waits for it to act on it.
    let mut interrupt = signal(SignalKind::interrupt()).map_err(Error::Io)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(Error::Io)?;
    let mut hangup = signal(SignalKind::hangup()).map_err(Error::Io)?;
    let status = loop {
        let passed = tokio::select! {
            status = child.wait() => break status.map_err(Error::Io)?,
            _ = interrupt.recv() => None,
            _ = terminate.recv() => Some(rustix::process::Signal::TERM),
            _ = hangup.recv() => Some(rustix::process::Signal::HUP),
        };
        if let (Some(sig), Some(pid)) = (passed, pid) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    };
    use std::os::unix::process::ExitStatusExt as _;
    Ok(status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_agent_is_pointed_the_way_it_reads() {
        let base = "http://127.0.0.1:4321";
        let claude = Agent::of(Path::new("/usr/bin/claude")).settings(base);
        assert_eq!(
            claude.env,
            [(
                "ANTHROPIC_BASE_URL".to_string(),
                "http://127.0.0.1:4321/anthropic".to_string()
            )]
        );
        let codex = Agent::of(Path::new("codex")).settings(base);
        assert!(codex.env.is_empty());
        assert!(codex
            .args
            .contains(&"model_providers.compactor.base_url=\"http://127.0.0.1:4321/v1\"".into()));
        assert!(codex
            .args
            .contains(&"model_providers.compactor.wire_api=\"responses\"".into()));
        assert_eq!(codex.args.iter().filter(|a| *a == "-c").count(), 5);
        let opencode = Agent::of(Path::new("opencode")).settings(base);
        let content: serde_json::Value =
            serde_json::from_str(&opencode.env[0].1).expect("JSON config");
        assert_eq!(
            opencode.defaults,
            [(
                "OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX".to_string(),
                "8192".to_string()
            )]
        );
        assert_eq!(
            content["provider"]["openai"]["options"]["baseURL"],
            "http://127.0.0.1:4321/v1"
        );
        let aider = Agent::of(Path::new("aider")).settings(base);
        let names: Vec<&str> = aider.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            ["OPENAI_BASE_URL", "OPENAI_API_BASE", "ANTHROPIC_BASE_URL"]
        );
        let printed = print_env(&codex);
        assert!(printed.starts_with("# and pass first: '-c' "), "{printed}");
        assert_eq!(
            print_env(&Agent::Gemini.settings(base)),
            "export GOOGLE_GEMINI_BASE_URL='http://127.0.0.1:4321/gemini'\n"
        );
    }

    #[test]
    fn a_local_compactor_listens_on_free_ports_with_the_routes_agents_need() {
        let config = Config::from_toml(
            "[[routes]]\nprefix = \"/anthropic\"\nbase_url = \"http://my-gateway:1\"\n",
        )
        .expect("config");
        let local = local(config);
        assert_eq!(local.server.listen.port(), 0);
        assert_eq!(local.server.admin_listen.port(), 0);
        let routes: Vec<(&str, &str)> = local
            .routes
            .iter()
            .map(|r| (r.prefix.as_str(), r.base_url.as_str()))
            .collect();
        assert_eq!(
            routes,
            [
                ("/anthropic", "http://my-gateway:1"),
                ("/gemini", GEMINI_API)
            ],
            "the user's own route is kept"
        );
        local.validate().expect("valid");
    }
}
