//! The `compactor` command line: load the configuration, set up logging, run.
//!
//! `serve` runs the proxy, `check-config` validates and prints the configuration, and
//! `compact` runs the compaction engine once over a request (Chat Completions, Messages or
//! Responses) read from a file or stdin: the request to forward on stdout, what happened on
//! stderr. `replay` runs recorded
//! conversations through the compactor offline and prints a table per file, what the
//! compactions forgot (probes), and optionally a chart and JSON.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use compactor::compact_once::CompactStatus;
use compactor::config::{Config, LogFormat, Strategy};
use compactor::dialect::DialectKind;
use compactor::reload::Reloader;
use compactor::Server;
use tracing_subscriber::EnvFilter;

/// The `--dialect` of `compact`: a format's command-line name
/// ([`DialectKind::cli_name`]), any of [`DialectKind::ALL`].
fn parse_dialect(name: &str) -> Result<DialectKind, String> {
    DialectKind::ALL
        .into_iter()
        .find(|d| d.cli_name() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = DialectKind::ALL.iter().map(|d| d.cli_name()).collect();
            format!("expected one of {}", names.join(", "))
        })
}

/// Exit status of `compact` when a compaction was due but did not happen (the original request
/// is still printed, so a pipeline reading stdout keeps a valid request).
const EXIT_COMPACTION_FAILED: u8 = 2;

#[derive(Parser)]
#[command(
    name = "compactor",
    version,
    about = "Context-compaction reverse proxy for LLM chat APIs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy and admin listeners until SIGTERM or SIGINT.
    Serve {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run an agent through compactor: `compactor run claude -- -p "fix the tests"`.
    ///
    /// Uses the compactor answering at the configured admin address, or starts one in this
    /// process on free local ports (adding `/anthropic` and `/gemini` routes when missing),
    /// points the agent at it the way it needs (Claude Code, Codex, opencode, Gemini CLI by
    /// name; aider and any other command by `OPENAI_BASE_URL`, `OPENAI_API_BASE` and
    /// `ANTHROPIC_BASE_URL`), runs it in the foreground and returns its exit code. On exit it
    /// prints one line of what compactor did (when it started it).
    Run {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print the settings for the agent (shell `export` lines) instead of running it.
        #[arg(long)]
        print_env: bool,
        /// The agent's command.
        agent: std::ffi::OsString,
        /// Its arguments (after `--`).
        #[arg(last = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Validate the configuration and print it, secrets redacted.
    CheckConfig {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Summarise one request (Chat Completions, Messages or Responses) with the configured
    /// summarizer, once.
    ///
    /// Runs the summary step as the `summarize` strategy runs it on a conversation's first
    /// request, and prints the rewritten request on stdout (the original bytes when nothing
    /// triggers) and the trigger, token estimates, boundary and summary on stderr. This is not
    /// always what the proxy forwards: old tool outputs are not masked here, whatever
    /// `compaction.strategy` says, and no session memory or background summary is used. Exit
    /// status: 0 printed; 1 invalid input or configuration; 2 a compaction was due but failed
    /// (the original request is printed). Summarizers that call a provider get no caller
    /// credentials here: configure `summarizer.openai.api_key_env` (or its `anthropic` twin).
    Compact {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The wire format of the request.
        #[arg(long, value_parser = parse_dialect, default_value = "chat-completions")]
        dialect: DialectKind,
        /// Summarizer backend (default `extractive`, no network); configured fallbacks are
        /// not used.
        #[arg(long, value_name = "NAME")]
        summarizer: Option<String>,
        /// The request body (JSON); stdin when absent or `-`.
        file: Option<PathBuf>,
    },
    /// Replay recorded conversations offline through the compactor and its session memory.
    ///
    /// Each TRANSCRIPT is a JSON file with a `messages` array (Chat Completions or Anthropic
    /// Messages) or an `input` array (Responses), sent request by request as an agent would
    /// (the request before each assistant turn carries everything before it), or a JSONL file
    /// of complete requests. Prints per request the messages, estimated tokens received and
    /// forwarded, compactions and summarizer calls so far, then a summary line per file, and
    /// ends with a `== probes` table: of what the compactions touched (task, user's words,
    /// files, error lines, identifiers), the share still in the forwarded requests.
    /// Nothing is sent to a provider unless `--summarizer` names a network backend.
    Replay {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Summarizer backend (default `extractive`); configured fallbacks are not used.
        #[arg(long, value_name = "NAME")]
        summarizer: Option<String>,
        /// Write an SVG chart of tokens received and forwarded per step, one panel per file.
        #[arg(long, value_name = "OUT")]
        svg: Option<PathBuf>,
        /// `compaction.strategy` to replay with (`summarize`, `mask`, `hybrid`), instead of
        /// the configured one; several, comma-separated, replay every file with each and end
        /// with a table comparing them (summarizer calls, tokens forwarded, prefix stability).
        #[arg(long, value_name = "NAME[,NAME...]", value_delimiter = ',')]
        strategy: Vec<String>,
        /// Write the totals of every replay as JSON: per file and strategy the summarizer,
        /// steps, compactions, summarizer calls, tokens forwarded and the probe scores (kept
        /// and total per category).
        #[arg(long, value_name = "OUT")]
        json: Option<PathBuf>,
        /// Show a recorded event log (`server.event_log`) instead: per conversation, the
        /// compactions, refusal retries, mask steps and failures it recorded, the tokens they
        /// removed and what the summaries cost.
        #[arg(long, value_name = "EVENT_LOG", conflicts_with_all = ["transcripts", "strategy", "svg", "json", "summarizer"])]
        events: Option<PathBuf>,
        /// Recorded conversations: JSON transcripts or JSONL files of requests.
        #[arg(required_unless_present = "events", value_name = "TRANSCRIPT")]
        transcripts: Vec<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Tells the operator about `COMPACTOR_*` variables that are not configuration.
fn warn_ignored_env(logging: bool) {
    for name in compactor::config::ignored_env_vars() {
        let why = "not a COMPACTOR_<SECTION>__<KEY> variable, so not configuration";
        if logging {
            tracing::warn!(variable = name, "ignoring {name}: {why}");
        } else {
            eprintln!("warning: ignoring {name}: {why}");
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Run {
            config,
            print_env,
            agent,
            args,
        } => {
            let config = Config::load(config.as_deref())?;
            init_tracing(config.server.log_format, "warn");
            let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
            runtime.block_on(run_agent(config, print_env, agent, args))
        }
        Command::CheckConfig { config } => {
            let config = Config::load(config.as_deref())?;
            warn_ignored_env(false);
            compactor::App::new(config.clone()).context("building components")?;
            let shown = config.redacted();
            print!("{}{}", shown.to_toml(), shown.route_settings());
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { config: path } => {
            let config = Config::load(path.as_deref())?;
            init_tracing(config.server.log_format, "info");
            warn_ignored_env(true);
            let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
            runtime.block_on(async {
                let server = Server::bind(config).await.context("starting the server")?;
                let reloader = tokio::spawn(Reloader::new(server.handle(), path).run());
                let served = server.run(shutdown_signal()).await;
                reloader.abort();
                served?;
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Compact {
            config,
            dialect,
            summarizer,
            file,
        } => {
            let config = Config::load(config.as_deref())?;
            init_tracing(config.server.log_format, "warn");
            let body = read_input(file.as_deref())?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            runtime.block_on(compact(&config, dialect, summarizer.as_deref(), &body))
        }
        Command::Replay {
            events: Some(events),
            ..
        } => {
            let text = std::fs::read_to_string(&events)
                .with_context(|| format!("reading {}", events.display()))?;
            let report = compactor::event_log::report(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", events.display()))?;
            write_stdout(report.as_bytes())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Replay {
            config,
            summarizer,
            svg,
            strategy,
            json,
            transcripts,
            events: None,
        } => {
            let config = Config::load(config.as_deref())?;
            init_tracing(config.server.log_format, "warn");
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            runtime.block_on(replay(
                config,
                summarizer.as_deref(),
                &strategy,
                &transcripts,
                svg.as_deref(),
                json.as_deref(),
            ))
        }
    }
}

/// Reads the request from `file`, or from stdin when it is absent or `-`.
fn read_input(file: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    match file {
        Some(path) if path != Path::new("-") => {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))
        }
        _ => {
            let mut body = Vec::new();
            std::io::stdin()
                .read_to_end(&mut body)
                .context("reading the request from stdin")?;
            Ok(body)
        }
    }
}

/// `compactor compact`: the library does the work; this prints its report.
async fn run_agent(
    config: Config,
    print_env: bool,
    agent: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
) -> anyhow::Result<ExitCode> {
    use compactor::run::{self, Agent, Proxy};
    if print_env {
        // Where `serve` with this configuration listens.
        let base = format!("http://{}", config.server.listen);
        print!(
            "{}",
            run::print_env(&Agent::of(Path::new(&agent)).settings(&base))
        );
        return Ok(ExitCode::SUCCESS);
    }
    let proxy = Proxy::find_or_start(config)
        .await
        .context("starting compactor")?;
    if let Some(page) = proxy.page() {
        eprintln!(
            "compactor: serving on {}; what it does: {page}",
            proxy.base()
        );
    }
    let code = run::agent(&agent, &args, &proxy.base()).await;
    if let Some(summary) = proxy.finish().await {
        eprintln!("{summary}");
    }
    let code = code?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

async fn compact(
    config: &Config,
    dialect: DialectKind,
    summarizer: Option<&str>,
    body: &[u8],
) -> anyhow::Result<ExitCode> {
    let report = compactor::compact_once::compact(config, dialect, summarizer, body).await?;
    std::io::stderr().write_all(report.notes.as_bytes())?;
    write_stdout(&report.forward)?;
    Ok(match report.status {
        CompactStatus::Unchanged | CompactStatus::Compacted => ExitCode::SUCCESS,
        CompactStatus::Failed => ExitCode::from(EXIT_COMPACTION_FAILED),
    })
}

/// `compactor replay`: every file is read before any is replayed, so a typo fails at once.
async fn replay(
    config: Config,
    summarizer: Option<&str>,
    strategies: &[String],
    files: &[PathBuf],
    svg: Option<&Path>,
    json: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    use compactor::replay;
    let strategies = strategies
        .iter()
        .map(|name| {
            Strategy::from_label(name.trim()).with_context(|| {
                format!("unknown strategy `{name}`: expected summarize, mask or hybrid")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let replayer = replay::Replayer::new(config, summarizer)?;
    let recordings = files
        .iter()
        .map(|f| replay::load(f))
        .collect::<Result<Vec<_>, _>>()?;
    let runs = if strategies.is_empty() {
        vec![replayer]
    } else {
        strategies
            .iter()
            .map(|s| {
                replay::Replayer::new(replayer.config().clone(), summarizer)
                    .map(|r| r.with_strategy(*s))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let mut reports = Vec::with_capacity(recordings.len() * runs.len());
    for recording in &recordings {
        for run in &runs {
            let report = run.run(recording).await?;
            let separator = if reports.is_empty() { "" } else { "\n" };
            write_stdout(format!("{separator}{}", report.render()).as_bytes())?;
            reports.push(report);
        }
    }
    if runs.len() > 1 {
        write_stdout(format!("\n{}", replay::comparison(&reports)).as_bytes())?;
    }
    if let Some(costs) = replay::costs(&reports) {
        write_stdout(format!("\n{costs}").as_bytes())?;
    }
    write_stdout(format!("\n{}", replay::probe_table(&reports)).as_bytes())?;
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&replay::to_json(&reports))?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = svg {
        std::fs::write(path, replay::svg::render(&reports))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "chart written to {} ({} panels)",
            path.display(),
            reports.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes).context("writing stdout")?;
    out.flush().context("writing stdout")?;
    Ok(())
}

fn init_tracing(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Completes on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; shutting down");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
