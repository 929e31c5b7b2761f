//! The `compactor` command line: load the configuration, set up logging, run.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use compactor::config::{Config, LogFormat};
use compactor::Server;
use tracing_subscriber::EnvFilter;

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
    /// Validate the configuration and print it, secrets redacted.
    CheckConfig {
        /// Config file (default: config/compactor.toml when present, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::CheckConfig { config } => {
            let config = Config::load(config.as_deref())?;
            compactor::App::new(config.clone()).context("building components")?;
            print!("{}", config.redacted().to_toml());
            Ok(())
        }
        Command::Serve { config } => {
            let config = Config::load(config.as_deref())?;
            init_tracing(config.server.log_format);
            let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
            runtime.block_on(async {
                let server = Server::bind(config).await.context("starting the server")?;
                server.run(shutdown_signal()).await?;
                anyhow::Ok(())
            })
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
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
