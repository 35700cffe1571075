//! The command line: `sluice [--config PATH]`, `sluice check`, `--version`.
//! Everything else lives in the library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

// mimalloc: fewer cycles per request than the system allocator on the hot
// path (many small, short-lived allocations in hyper and the proxy).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "A reverse proxy with built-in rate limiting"
)]
struct Cli {
    /// Configuration file.
    #[arg(
        long,
        global = true,
        env = "SLUICE_CONFIG",
        default_value = "config.toml"
    )]
    config: PathBuf,
    /// Log format on stderr (the RUST_LOG filter applies to both).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate the configuration, print the compiled routes and policies, exit 0/1.
    Check,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    let result = match cli.command {
        Some(Command::Check) => check(&cli.config),
        None => serve(&cli.config),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logs(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        );
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn check(path: &std::path::Path) -> anyhow::Result<()> {
    let config = sluice::config::load(path)?;
    // Not print!: a closed pipe (`sluice check | head`) must not panic.
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{config}").and_then(|_| writeln!(out, "{}: ok", path.display()));
    Ok(())
}

fn serve(path: &std::path::Path) -> anyhow::Result<()> {
    let config = sluice::config::load(path)?;
    disable_transparent_huge_pages();
    raise_open_files_limit(config.server.max_connections);
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // One worker: a current-thread runtime, which schedules without the
    // atomics and wakeups a work-stealing pool needs.
    let runtime = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
    }
    .context("cannot start the runtime")?;
    runtime.block_on(async {
        let addr = config.server.listen;
        // A client that connects and sends nothing is handed over (and its
        // header_timeout begun) after about header_timeout.
        let (backlog, defer) = (config.server.listen_backlog, config.server.header_timeout);
        let listener = sluice::server::listen(addr, backlog, defer)
            .with_context(|| format!("cannot listen on {addr}"))?;
        let admin = config.server.admin_listen;
        let server = sluice::Server::new(listener, config)?;
        tracing::info!(listen = %addr, workers, "sluice is serving");
        if let Some(admin) = admin {
            tracing::info!(%admin, "admin endpoints: /healthz /readyz /metrics /usage");
        }
        let proxy = server.proxy();
        let path = path.to_path_buf();
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                tracing::warn!("cannot listen for SIGHUP: reload is off");
                return;
            };
            while hup.recv().await.is_some() {
                // The reason for a refusal is logged by reload itself.
                let _ = proxy.reload(&path);
            }
        });
        server.run(shutdown_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
}

/// Turns transparent huge pages off for this process, as Redis does. The
/// allocator asks for them, and the first touch of one zeroes 2 MiB while a
/// request waits: 3-6 ms on the 2-core VM, on one of the first requests and
/// again whenever the heap grows. sluice's heap is small enough for 4 KiB
/// pages to cost nothing measurable (wrk -c50, memory store: CPU per request
/// 0.97x with them off, within the noise). A kernel that refuses keeps its
/// default.
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "transparent huge pages stay on");
    }
}

/// Raises the soft limit on open files to the hard limit, as nginx's
/// `worker_rlimit_nofile` does by hand: the usual soft limit (1,024) is used
/// up by about a thousand slow clients, each holding a descriptor (two, with
/// its upstream connection), and then no new client can connect.
fn raise_open_files_limit(max_connections: usize) {
    #[cfg(target_os = "linux")]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read and write the struct given, nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return;
        }
        let soft = limit.rlim_cur;
        if soft < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0 {
                tracing::info!(
                    from = soft,
                    to = limit.rlim_max,
                    "raised the open files limit (RLIMIT_NOFILE) to its hard limit"
                );
            } else {
                limit.rlim_cur = soft;
                tracing::warn!(error = %std::io::Error::last_os_error(), limit = soft, "cannot raise the open files limit");
            }
        }
        // Each client connection holds a descriptor (and, while its request
        // is upstream, a second one); a few more are the process's own.
        if limit.rlim_cur < (max_connections as u64).saturating_add(64) {
            tracing::warn!(
                open_files = limit.rlim_cur,
                max_connections,
                "the open files limit is below server.max_connections: past it, accepts fail until descriptors are free (raise the hard limit, e.g. LimitNOFILE in systemd)"
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = max_connections;
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers there is nothing to wait for but Ctrl-C.
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
