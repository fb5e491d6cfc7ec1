//! `idem`: the command line. `serve` runs the service; `keys` manages API keys directly in
//! the database; `ops`, `acquire` and `complete` talk to a running server over HTTP.

mod bench;
mod bench_relay;
mod bench_workflows;
mod cli;
mod client;
mod keys;
#[cfg(feature = "otel")]
mod otel;
mod outbox;
mod output;
mod serve;
mod wf;

use clap::Parser as _;
use std::process::ExitCode;

/// mimalloc instead of glibc malloc: allocation and free were about a quarter of the
/// instructions of an acquire or a completion (scripts/callgrind.sh: 816 000 -> 697 000
/// instructions per pair; natively about 9 % less user CPU per pair at concurrency 32).
/// The price is resident memory: mimalloc commits its arenas up front on Linux, so an idle
/// `idem serve` holds about 35 MiB instead of 19 MiB, 49 MiB instead of 31 MiB after 9 600
/// pairs at concurrency 32 (still under the 64 MiB goal). `MIMALLOC_ARENA_EAGER_COMMIT=0`
/// in the environment brings that to 22 / 36 MiB; every `MIMALLOC_*` variable applies as
/// mimalloc documents. mimalloc hands freed memory back to the operating system on its
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

fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = e.chain().map(|c| c.to_string()).collect();
    parts.dedup();
    parts.join(": ").replace('\n', " ")
}

async fn dispatch(cli: cli::Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        cli::Command::Serve(args) => serve::run(args).await.map(|()| ExitCode::SUCCESS),
        cli::Command::Proxy(args) => serve::run_proxy(args).await.map(|()| ExitCode::SUCCESS),
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
