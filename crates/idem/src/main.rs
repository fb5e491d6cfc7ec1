//! `idem`: the command line. `serve` runs the service; `keys` manages API keys directly in
//! the database; `ops`, `acquire` and `complete` talk to a running server over HTTP.

mod bench;
mod bench_mcp;
mod bench_relay;
mod bench_workflows;
mod cli;
mod client;
mod keys;
mod mcp;
#[cfg(feature = "otel")]
mod otel;
mod outbox;
mod output;
mod reference;
mod serve;
mod wf;

use clap::Parser as _;
use std::process::ExitCode;

/// mimalloc instead of glibc malloc: allocation and free were about a quarter of the
/// instructions of an acquire or a completion (scripts/callgrind.sh: 816 000 -> 697 000
/// instructions per pair; natively about 9 % less user CPU per pair at concurrency 32).
/// By default mimalloc commits its arenas up front on Linux, which cost resident memory
/// (peak RSS under `idem bench` 63–71 MiB against a 64 MiB goal); idem turns that off
/// before the first allocation ([`arena_commit_on_demand`]: 36–41 MiB, same throughput).
/// Every `MIMALLOC_*` variable applies as mimalloc documents, `MIMALLOC_ARENA_EAGER_COMMIT`
/// included. mimalloc hands freed memory back to the operating system on its
/// own (after its purge delay), which `crates/idem/tests/memory.rs` checks after a burst
/// of wide payloads.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `println!` that ends the process quietly when stdout is closed (`idem … | head`)
/// instead of panicking on the broken pipe.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout().lock(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

/// `mi_option_arena_eager_commit` in mimalloc v3's `mimalloc.h` (`mi_option_e`: 0
/// show_errors, 1 show_stats, 2 verbose, 3 deprecated_eager_commit, 4 arena_eager_commit).
#[cfg(target_os = "linux")]
const MI_OPTION_ARENA_EAGER_COMMIT: std::os::raw::c_int = 4;

#[cfg(target_os = "linux")]
unsafe extern "C" {
    /// mimalloc's `void mi_option_set(mi_option_t option, long value)`, linked in with
    /// the allocator (libmimalloc-sys binds it only behind a feature that needs one more
    /// crate).
    fn mi_option_set(option: std::os::raw::c_int, value: std::os::raw::c_long);
    fn getenv(name: *const std::os::raw::c_char) -> *const std::os::raw::c_char;
}

/// mimalloc commits its arenas up front on Linux by default, and memory a burst touched
/// then stays resident; with that off (mimalloc's `MIMALLOC_ARENA_EAGER_COMMIT=0`) the
/// server's peak RSS under `idem bench` fell from 63–71 MiB to 37–39 MiB with no loss of
/// throughput. It must be set before the first allocation reserves an arena, which Rust's
/// runtime makes before `main`: hence a constructor, which allocates nothing (libc
/// `getenv`, not `std::env`). An explicit `MIMALLOC_ARENA_EAGER_COMMIT` still wins.
#[cfg(target_os = "linux")]
extern "C" fn arena_commit_on_demand() {
    // SAFETY: getenv reads the environment the process started with (no thread exists
    // yet); mi_option_set only stores the option's value.
    unsafe {
        if getenv(c"MIMALLOC_ARENA_EAGER_COMMIT".as_ptr()).is_null() {
            mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        }
    }
}

#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static ARENA_COMMIT_ON_DEMAND: extern "C" fn() = arena_commit_on_demand;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            // One line, no backtrace: the message names what was wrong.
            eprintln!("idem: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// A command line clap refused: help and version print as clap prints them; a usage
/// error is one line (`idem: …`, with the command's usage) and exit status 2.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
        || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    {
        let _ = e.print();
        return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
    }
    let text = e.render().to_string();
    // clap's message: its first line, and for missing arguments the indented list below it
    // (which the first line alone left out: "were not provided: (usage …)").
    let message: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty() && !l.trim_start().starts_with("Usage:"))
        .map(|l| l.trim().trim_start_matches("error: "))
        .collect();
    let usage = match text.lines().find_map(|l| l.trim().strip_prefix("Usage: ")) {
        Some(u) => u.to_owned(),
        None => command_path(),
    };
    eprintln!("idem: {} (usage: {usage}; see --help)", message.join(" "));
    ExitCode::from(2)
}

/// `idem` and the subcommands named on this command line (`idem wf rerun`), for a usage
/// error whose message has no usage line of its own (an invalid value).
fn command_path() -> String {
    let mut cmd = <cli::Cli as clap::CommandFactory>::command();
    let mut path = vec!["idem".to_owned()];
    for arg in std::env::args().skip(1).filter(|a| !a.starts_with('-')) {
        let Some(sub) = cmd.find_subcommand(&arg).cloned() else { break };
        path.push(arg);
        cmd = sub;
    }
    path.join(" ") + " …"
}

/// The error and its causes on one line. A cause whose text the line already holds is
/// left out (thiserror's `{0}` puts a source's text into its own), and a database error
/// ends the chain with the server's message ([`idem_store::database_message`]).
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        if let Some(db) = cause.downcast_ref::<sqlx::Error>() {
            // A wrapper may have put sqlx's own text in its message already: say it the
            // plain way there too.
            let (raw, plain) = (db.to_string(), idem_store::database_message(db));
            for p in &mut parts {
                *p = p.replace(&raw, &plain);
            }
            if !parts.iter().any(|p| p.contains(&plain)) {
                parts.push(plain);
            }
            break;
        }
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ").replace('\n', " ")
}

async fn dispatch(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Serve(args) => serve::run(args).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Proxy(args) => serve::run_proxy(*args).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Mcp(args) => mcp::run(args).await.map(|()| ExitCode::SUCCESS),
        cli::Command::McpOps(args) => mcp::run_ops(args).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Keys(k) => keys::run(k).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Ops(o) => client::ops(o).await,
        cli::Command::Wf(w) => wf::run(w).await,
        cli::Command::Acquire(a) => client::acquire(a).await,
        cli::Command::Renew(r) => client::renew(r).await,
        cli::Command::Complete(c) => client::complete(c).await,
        cli::Command::Scenarios(s) => scenarios(s).await,
        cli::Command::Schema(s) => outbox::schema(s).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Relay(r) => outbox::relay(r).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Outbox(o) => outbox::outbox(o).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Reference(r) => reference_pages(r).map(|()| ExitCode::SUCCESS),
        cli::Command::Bench(b) => bench::run(bench::BenchArgs {
            seconds: b.seconds,
            concurrency: b.concurrency,
            http_concurrency: b.http_concurrency,
            postgres_url: b.postgres_url,
            nats_url: b.nats_url,
        })
        .await
        .map(|()| ExitCode::SUCCESS),
    }
}

/// `idem reference`: print one generated page of the book, or write them all.
fn reference_pages(args: cli::ReferenceArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    match (args.page, args.write) {
        (_, Some(dir)) => {
            for (page, file) in reference::PAGES {
                let path = dir.join(file);
                std::fs::write(&path, reference::render(page))
                    .with_context(|| format!("cannot write {}", path.display()))?;
                out!("idem: wrote {}", path.display());
            }
        }
        (Some(page), None) => {
            use std::io::Write as _;
            let _ = std::io::stdout().lock().write_all(reference::render(page).as_bytes());
        }
        (None, None) => anyhow::bail!("name a page (cli, http-api, problems) or --write DIR"),
    }
    Ok(())
}

async fn scenarios(cmd: cli::ScenariosCommand) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    use idem::acceptance::{provider, runner};
    match cmd {
        cli::ScenariosCommand::Run { server, file, provider } => {
            let parse =
                |what: &str, u: &str| reqwest::Url::parse(u).with_context(|| format!("{what} {u:?} is not a URL"));
            let target = runner::Target {
                server: parse("--server", &server.server)?,
                api_key: server.api_key()?,
                provider: parse("--provider", &provider)?,
            };
            let rows = runner::run(&runner::load(&file)?, target).await?;
            if server.json {
                let v: Vec<serde_json::Value> = rows
                    .iter()
                    .map(|r| serde_json::json!({"id": r.id, "title": r.title, "expected": r.expected, "actual": r.actual, "evidence": r.evidence, "result": r.result}))
                    .collect();
                out!("{}", serde_json::Value::Array(v));
            } else {
                out!("{}", runner::render(&rows).trim_end());
            }
            Ok(if rows.iter().any(|r| r.result == "FAIL") { ExitCode::FAILURE } else { ExitCode::SUCCESS })
        }
        cli::ScenariosCommand::Provider { listen } => {
            let listener =
                tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("cannot listen on {listen}"))?;
            out!("idem: provider double listening on http://{}", listener.local_addr()?);
            provider::Provider::new().serve(listener).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
