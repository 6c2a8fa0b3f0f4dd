//! The `kvroute` command: parses the command line and calls into the library.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use kvroute::config::{Config, Overrides, POLICY_ENV};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "Prefix-aware routing gateway for vLLM pools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// YAML config file.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Validate the config and exit.
        #[arg(long)]
        check: bool,
        /// Listen address (overrides the file).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Worker base URL, repeatable (replaces the file's list).
        #[arg(long = "worker")]
        workers: Vec<String>,
        /// Routing policy: round_robin, least_conn or prefix (overrides the file).
        #[arg(long, env = POLICY_ENV)]
        policy: Option<String>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_http=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve {
            config,
            check,
            listen,
            workers,
            policy,
        } => {
            let overrides = Overrides {
                listen,
                workers,
                policy,
            };
            let config = match Config::load(config.as_deref(), overrides) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("kvroute: {e}");
                    return ExitCode::from(2);
                }
            };
            if check {
                println!(
                    "config ok: policy {}, {} worker(s)",
                    config.policy.name(),
                    config.workers.len()
                );
                return ExitCode::SUCCESS;
            }
            run(async move {
                let listener = tokio::net::TcpListener::bind(config.listen).await?;
                let shutdown = CancellationToken::new();
                tokio::spawn(signal_to(shutdown.clone()));
                kvroute::server::serve(listener, config, shutdown).await
            })
        }
    }
}

async fn signal_to(token: CancellationToken) {
    kvroute::server::shutdown_signal().await;
    token.cancel();
}

fn run(fut: impl std::future::Future<Output = std::io::Result<()>>) -> ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute: {e}");
            ExitCode::FAILURE
        }
    }
}
