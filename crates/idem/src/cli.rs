//! The command-line grammar (clap). Every flag with an environment variable says so in
//! `--help`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Default database: an SQLite file in the working directory, created on first start.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://idem.db";

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Make side effects safe to retry: one idempotency key, at most one side effect.",
    long_about = concat!(
        "idem records each business intent under an idempotency key and a payload fingerprint, ",
        "lets exactly one worker execute it (lease + fencing token), and answers repeated triggers ",
        "with the recorded result instead of a second side effect. A timeout is UNKNOWN, never ",
        "\"it did not happen\".\n\n",
        "Start the service (SQLite file ./idem.db, http://127.0.0.1:8080):\n",
        "  idem serve\n",
        "Then, with IDEM_API_KEY set to the key `serve` printed on first start:\n",
        "  idem acquire INQ-001:confirmation:v1 --action send_confirmation --payload '{\"to\":\"c-42\"}'\n",
        "  idem complete INQ-001:confirmation:v1 --token TOKEN --outcome succeeded --provider-ref msg-001\n",
        "  idem ops get INQ-001:confirmation:v1\n\n",
        "The HTTP API is described at /openapi.json on the running server."
    )
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service (API under /v1, OpenAPI at /openapi.json).
    Serve(ServeArgs),
    /// Put Idempotency-Key semantics (IETF httpapi draft) in front of an existing HTTP API;
    /// idem's own API is served under /_idem/.
    Proxy(Box<ProxyArgs>),
    /// An MCP guard for AI agents: start it instead of a tool server; every side-effecting
    /// tool call of a task becomes one operation (replayed when repeated, never sent twice).
    #[command(long_about = MCP_HELP)]
    Mcp(McpArgs),
    /// A read-only MCP server (stdio) of idem's own: an agent asks what became of an
    /// operation (get_operation, list_operations, operation_events), e.g. one a guard
    /// answered with "outcome unknown". It changes nothing.
    McpOps(McpOpsArgs),
    /// Manage API keys, directly in the database the server uses.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Operations on a running server: get and list (any key), reconcile and resolve
    /// (operator role; they change the operation and are audited).
    #[command(subcommand)]
    Ops(OpsCommand),
    /// Workflows on a running server: start, show and list instances; re-run and compensate
    /// them (operator role).
    #[command(subcommand)]
    Wf(WfCommand),
    /// Trigger an operation: acquire its lease, or learn its recorded outcome.
    ///
    /// Exit status — one meaning each, whatever performs the effect:
    /// 0 = lease granted to you (201: do the side effect, then `idem complete`); only ever
    /// for an operation you perform, never when a connector of idem's performs it;
    /// 10 = replay of an operation that finished before (200: do nothing);
    /// 14 = idem performed it during this call, with a connector (yours or the action's
    /// default), and it finished: SUCCEEDED or FAILED, printed (200: do nothing);
    /// 11 = not final and not yours: UNKNOWN, or idem's attempt still running or its retry
    /// scheduled (202: do nothing; `idem ops get` shows how it ends);
    /// 12 = in progress or retry not due (409: try later);
    /// 13 = late arrival: finished long ago, only its tombstone is left (410: do nothing,
    /// never retry);
    /// 1 = error (bad input, 422 key reused with another payload, server unreachable).
    ///
    /// Each call is one attempt with a holder of its own (a new UUID, or --holder): a
    /// reply lost on the way is resent with it, and gets the same grant back.
    Acquire(AcquireArgs),
    /// Renew the lease of a fencing token (a heartbeat): it then ends --lease-ms from now.
    ///
    /// Only a valid lease is renewed. A lease that already expired, another token, or an
    /// operation that is not EXECUTING is refused (exit 1, one line naming the problem
    /// type): after `lease-expired`, stop and `idem complete` with the token to report
    /// what happened.
    Renew(RenewArgs),
    /// Report the outcome of the attempt that holds a fencing token.
    ///
    /// A completion repeated with the same token and outcome gets the same answer, so a
    /// reply lost on the way is resent (up to 3 times, 250 ms apart) before exit 1 says
    /// the server cannot be reached; running the same command again is safe too.
    Complete(CompleteArgs),
    /// The idem schema in an application's own database: outbox, inbox and key claims that
    /// commit with the application's transaction (SQL functions for any language).
    #[command(subcommand)]
    Schema(SchemaCommand),
    /// Deliver an application database's outbox events at least once, to webhooks and
    /// NATS JetStream, as [outbox] in the config file says (runs until stopped).
    Relay(RelayArgs),
    /// Outbox events and dead letters in an application's database: list, show, and an
    /// operator's redrive or skip (with a mandatory reason, audited).
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Measure idem against naive baselines on this machine and print the table.
    Bench(BenchCli),
    /// The acceptance matrix: run a scenario file, or serve the provider double it uses.
    #[command(subcommand)]
    Scenarios(ScenariosCommand),
    /// The book's generated reference pages (docs/src/reference/): print one, or write
    /// all of them into a directory. Hidden: for the project's own docs.
    #[command(hide = true)]
    Reference(ReferenceArgs),
}

/// A generated page of the book's reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReferencePage {
    /// The command line (clap's help of every command).
    Cli,
    /// The HTTP API (the OpenAPI document).
    HttpApi,
    /// The problem types (`/problems/{slug}`).
    Problems,
}

#[derive(Debug, Args)]
pub struct ReferenceArgs {
    /// The page to print on stdout.
    #[arg(required_unless_present = "write")]
    pub page: Option<ReferencePage>,
    /// Write every page into this directory (cli.md, http-api.md, problems.md).
    #[arg(long, value_name = "DIR", conflicts_with = "page")]
    pub write: Option<PathBuf>,
}

/// `--seconds` of `idem bench`: a number of seconds from 0.1 to 3600.
/// A key, id or name the command puts in a URL path: not empty, not `.` or `..` (a URL
/// would resolve those as directory steps, RFC 3986 §5.2.4, and the request would reach
/// another route, or none). The server checks everything else.
fn path_segment(s: &str) -> Result<String, String> {
    match s {
        "" => Err("must not be empty".into()),
        "." | ".." => Err("cannot be \".\" or \"..\" (URLs treat those as directory steps)".into()),
        _ => Ok(s.to_owned()),
    }
}

/// A size in bytes of at least 1 (`--max-body-bytes 0` would refuse every body with 413).
fn at_least_one_byte(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1 (bytes)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e} (a number of bytes)")),
    }
}

fn seconds_in_range(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds from 0.1 to 3600")),
    }
}

#[derive(Debug, Args)]
pub struct BenchCli {
    /// Seconds per measurement (0.1-3600).
    #[arg(long, default_value_t = 3.0, value_parser = seconds_in_range)]
    pub seconds: f64,
    /// Concurrencies of the embedded SQLite runs (comma-separated).
    #[arg(long, default_value = "1,16,64,256", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Concurrency of the HTTP runs.
    #[arg(long, default_value_t = 32)]
    pub http_concurrency: usize,
    /// PostgreSQL admin URL for the PostgreSQL runs (databases are created on it).
    #[arg(long, env = "IDEM_BENCH_PG_URL")]
    pub postgres_url: Option<String>,
    /// NATS server (with JetStream) for the relay's NATS rows, e.g. nats://127.0.0.1:4222;
    /// a stream is created and deleted. Needs --postgres-url too.
    #[arg(long, env = "IDEM_BENCH_NATS_URL")]
    pub nats_url: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum ScenariosCommand {
    /// Run a scenario file (e.g. scenarios/acceptance.toml) against a running idem and the
    /// provider double; prints the matrix, exits 1 if any scenario fails.
    Run {
        #[command(flatten)]
        server: ServerArgs,
        /// The scenario file.
        file: std::path::PathBuf,
        /// Base URL of the provider double (`idem scenarios provider`).
        #[arg(long, env = "IDEM_SCENARIO_PROVIDER", default_value = "http://127.0.0.1:8090")]
        provider: String,
    },
    /// Serve the scriptable provider double (an order API) that scenario files drive.
    Provider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8090")]
        listen: String,
    },
}

#[derive(Debug, Args)]
pub struct DbArgs {
    /// Database: `sqlite://PATH` (or a plain path) for the embedded store, or
    /// `postgres://user@host:port/db` for several nodes.
    #[arg(long, env = "IDEM_DATABASE_URL", default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Address to listen on, HOST:PORT (port 0 picks a free port; the bound address is
    /// printed).
    #[arg(long, env = "IDEM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Largest accepted request body, in bytes.
    #[arg(long, env = "IDEM_MAX_BODY_BYTES", default_value_t = idem_server::DEFAULT_MAX_BODY_BYTES, value_parser = at_least_one_byte)]
    pub max_body_bytes: usize,
    /// Request body bytes this node reads and processes at once, over all requests (a
    /// payload takes a multiple of its size while it is parsed, fingerprinted and
    /// stored, so this bounds the node's memory). Beyond it a request waits up to
    /// --inflight-wait-ms, then gets 503 overloaded with Retry-After. At least
    /// --max-body-bytes (a lower value is raised to it, and the 503 says so).
    #[arg(long, env = "IDEM_MAX_INFLIGHT_BODY_BYTES", default_value_t = idem_server::request_body::DEFAULT_MAX_INFLIGHT_BODY_BYTES)]
    pub max_inflight_body_bytes: usize,
    /// How long a request waits for room under --max-inflight-body-bytes, in
    /// milliseconds, before 503 overloaded.
    #[arg(long, env = "IDEM_INFLIGHT_WAIT_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub inflight_wait_ms: u64,
    /// Longest time a client may take to send a whole request body, in milliseconds;
    /// then 408 request-timeout and the connection is closed.
    #[arg(long, env = "IDEM_BODY_READ_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub body_read_timeout_ms: u64,
    /// Longest time a client may take to send a request's headers, in milliseconds; then
    /// the connection is closed (a client that connects and sends nothing too).
    #[arg(long, env = "IDEM_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub header_read_timeout_ms: u64,
    /// How often expired leases are turned into UNKNOWN, in milliseconds.
    #[arg(long, env = "IDEM_SWEEP_INTERVAL_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub sweep_interval_ms: u64,
    /// PostgreSQL: every node judges leases, retries and retention on the database's
    /// clock, read every 15 s and carried forward on the node's monotonic clock. Beyond
    /// this uncertainty (half the reading's round trip plus 100 ppm drift since), in
    /// milliseconds, the node logs a warning and /readyz answers 503. Unused on SQLite
    /// (one machine, one clock).
    #[arg(long, env = "IDEM_MAX_CLOCK_UNCERTAINTY_MS", default_value_t = idem_store::postgres::DEFAULT_MAX_UNCERTAINTY_MS, value_parser = clap::value_parser!(i64).range(1..=60_000))]
    pub max_clock_uncertainty_ms: i64,
    /// How long a request waits for a database connection, in milliseconds, before it is
    /// answered 503 `unavailable` with Retry-After. While PostgreSQL is down every request
    /// fails within this instead of holding a worker; it recovers on its own once the
    /// database is back.
    #[arg(long, env = "IDEM_DB_ACQUIRE_TIMEOUT_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    pub db_acquire_timeout_ms: u64,
    /// PostgreSQL: how long a request waits for the database's answer (a statement, a
    /// commit waiting for a synchronous standby, a row lock), in milliseconds, before it is
    /// answered 503 `unavailable` with Retry-After: what it sent may or may not have been
    /// recorded, and the same request sent again finds out. Bounds the wait on a database a
    /// network partition cut off (no reset arrives; TCP would give up after minutes).
    #[arg(long, env = "IDEM_DB_ANSWER_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub db_answer_timeout_ms: u64,
    /// Secret of the admin key (tenant "default") to create on first start; without it a
    /// key is generated and printed once. 32-256 printable ASCII characters without
    /// spaces; a key that breaks this fails the start before anything is created.
    #[arg(long, env = "IDEM_BOOTSTRAP_KEY", hide_env_values = true)]
    pub bootstrap_key: Option<String>,
    /// Configuration file (TOML; the book's "Configuration file" reference): connectors,
    /// action defaults, retention, workflows, the outbox relay, executor and reconciler
    /// settings. Without it idem runs no connectors.
    #[arg(long, env = "IDEM_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// Check the configuration file (--config) as a start would — every connector,
    /// workflow, [outbox] and retention setting, secrets from the environment and files
    /// included — then exit: 0 and one line when it would start, 1 and one line naming
    /// the field otherwise. Opens no database, binds no port.
    #[arg(long)]
    pub check_config: bool,
    /// Log format on stderr (level via RUST_LOG, default info).
    #[arg(long, env = "IDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Keep raw idempotency keys out of the logs: log lines then carry only `key_hash`
    /// (the first 16 hex digits of the key's SHA-256).
    #[arg(long, env = "IDEM_REDACT_KEYS")]
    pub redact_keys: bool,
    /// Require `Authorization: Bearer TOKEN` on /metrics (its labels name every tenant's
    /// actions and error classes). Without it /metrics is open.
    #[arg(long, env = "IDEM_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,
    /// Export traces (one span per HTTP request) to this OpenTelemetry collector, over
    /// OTLP/HTTP with protobuf: a base URL such as http://127.0.0.1:4318 (spans go to
    /// {URL}/v1/traces). Service name `idem`, or OTEL_SERVICE_NAME. Needs an idem built
    /// with `--features otel`; without it, giving this fails at start.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// `idem mcp --help`.
const MCP_HELP: &str = concat!(
    "An MCP guard for AI agents (README \"AI agents: idem mcp\"). The agent's host starts it instead of a ",
    "tool server; to the host it is that server (stdio, or Streamable HTTP with --listen), to the real server ",
    "(the command after --, or --server-url) it is a client. tools/list, resources, prompts and notifications ",
    "pass through unchanged. A tools/call of a guarded tool (every tool whose readOnlyHint is not true, unless ",
    "the config file says otherwise) is one operation per intent in idem's ledger: key = task id + tool + ",
    "intent fields (RFC 8785).\n\n",
    "What the agent is told, in the tool result: the first call is sent and its result returned as it came; a ",
    "repeat of a finished call gets the recorded result after one line \"idem: already done at … (operation …)\" ",
    "and _meta io.idem/replayed: true; a repeat while it runs waits wait_ms (config file, default 5000), then a tool ",
    "error \"in progress\"; the same intent with other arguments a tool error naming them; a call whose answer ",
    "was lost (timeout, dropped connection, killed guard or server) a tool error \"idem: outcome unknown\" until ",
    "a lookup tool or an operator settles it. Never a silent second call.\n\n",
    "Task id: per call in _meta \"io.idem/task-id\", else --task-id (IDEM_MCP_TASK_ID), else with ",
    "--task-per-process a new random one per start. With none of them a guarded call is refused (a tool error ",
    "saying how to set one): a default must never make a new task a replay of an old one.\n\n",
    "Ledger: the database idem serve uses (--database-url), tenant \"default\" (config tenant), principal ",
    "idem-mcp, keys mcp:SERVER:TASK:TOOL:HASH; unknown calls go to the review queue (idem ops list ",
    "--needs-review) unless the tool has a lookup. Counters idem_mcp_calls_total{tool,decision} at ",
    "--metrics-listen ADDR /metrics.\n\n",
    "Host configuration:\n",
    "  {\"mcpServers\": {\"tickets\": {\"command\": \"idem\", \"args\": [\"mcp\", \"--config\", \"guard.toml\",\n",
    "   \"--task-per-process\", \"--\", \"python\", \"server.py\"]}}}"
);

/// `idem mcp-ops`.
#[derive(Debug, Args)]
pub struct McpOpsArgs {
    /// The tenant whose operations it shows (the guard's default is "default").
    #[arg(long, default_value = "default")]
    pub tenant: String,
    #[command(flatten)]
    pub db: DbArgs,
}

/// `idem mcp`.
#[derive(Debug, Args)]
pub struct McpArgs {
    /// The guard's config file (TOML): which tools are guarded, intent fields, times, tool
    /// errors, the idempotency-key argument and lookup tools. Default: every tool whose
    /// readOnlyHint is not true is guarded with the defaults.
    #[arg(long, env = "IDEM_MCP_CONFIG")]
    pub config: Option<PathBuf>,
    /// The task id of every call that names none in its _meta ("io.idem/task-id"): the
    /// same task id makes a repeated call a replay, also after a restart.
    #[arg(long, env = "IDEM_MCP_TASK_ID", conflicts_with = "task_per_process")]
    pub task_id: Option<String>,
    /// Each start of the guard is a new task (a random UUIDv7, printed to stderr): repeats
    /// within the process are replayed, a restart never replays an earlier start's calls.
    #[arg(long)]
    pub task_per_process: bool,
    /// Serve the host over Streamable HTTP at http://ADDR/mcp instead of stdio.
    #[arg(long)]
    pub listen: Option<String>,
    /// The real server's Streamable HTTP endpoint, instead of a command after --.
    #[arg(long, conflicts_with = "server_command")]
    pub server_url: Option<String>,
    /// Serve Prometheus metrics (idem_mcp_calls_total{tool,decision}) at http://ADDR/metrics.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// How long the real server may take to start and complete the MCP handshake, in ms.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub start_timeout_ms: u64,
    #[command(flatten)]
    pub db: DbArgs,
    /// The real server's command and its arguments (after --).
    #[arg(last = true, value_name = "SERVER COMMAND")]
    pub server_command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Base URL of the API to protect, e.g. http://127.0.0.1:9000/.
    #[arg(long, env = "IDEM_PROXY_UPSTREAM")]
    pub upstream: String,
    /// Methods that need an Idempotency-Key (comma-separated).
    #[arg(long, default_value = "POST,PATCH")]
    pub methods: String,
    /// Only paths with this prefix need one (repeatable; default: every path).
    #[arg(long = "route-prefix")]
    pub route_prefix: Vec<String>,
    /// A request header that is part of the fingerprint (repeatable).
    #[arg(long = "fingerprint-header")]
    pub fingerprint_header: Vec<String>,
    /// A response header stored and replayed besides content-type, location, etag,
    /// content-language (repeatable).
    #[arg(long = "store-header")]
    pub store_header: Vec<String>,
    /// Largest upstream response body stored for replay, in bytes (a larger one is
    /// replayed without its body, with Idem-Body-Omitted: true).
    #[arg(long, default_value_t = 1024 * 1024)]
    pub max_stored_body_bytes: usize,
    /// Upstream timeout in milliseconds; after it the outcome is UNKNOWN (never re-sent).
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
    /// Upstream statuses after which a request's outcome is UNKNOWN, like a timeout: the
    /// client gets problem outcome-unknown and its retries 409, never forwarded again
    /// until the lookup or an operator settles it. LIST is comma-separated 5xx statuses or
    /// `none`; PREFIX=LIST sets it for paths starting with PREFIX (the longest matching
    /// prefix wins), e.g. --outcome-unknown-statuses /search=none. Repeatable. Default:
    /// every 5xx but 501, 503, 505 and 511, which prove the upstream did not act. Statuses
    /// left out are passed on and released for the client's retry.
    #[arg(long = "outcome-unknown-statuses", value_name = "[PREFIX=]LIST")]
    pub outcome_unknown_statuses: Vec<String>,
    /// `true` for routes whose upstream deduplicates by Idempotency-Key itself (answers a
    /// repeated key with the first request's result, as Stripe does), like a connector's
    /// provider_deduplicates: there an outcome-unknown status or a 409 is passed on as the
    /// upstream sent it and a timeout or reset is problem upstream-no-answer (504, 502);
    /// nothing is stored, and the client's retry is forwarded with the same key. BOOL is
    /// true or false; PREFIX=BOOL sets it for paths starting with PREFIX (the longest
    /// matching prefix wins), e.g. --provider-deduplicates /v1/=true. Repeatable.
    /// Default: false everywhere.
    #[arg(long = "provider-deduplicates", value_name = "[PREFIX=]BOOL")]
    pub provider_deduplicates: Vec<String>,
    /// How the proxy renders its own errors (400, 401, 409, 413, 415, 422, outcome-unknown,
    /// 502/504 ...; never the upstream's answers): `problem` (RFC 9457
    /// application/problem+json) or `stripe` (Stripe's {"error":{"type","code","message"}}
    /// with Stripe-Should-Retry, for clients of a Stripe-style API: a reused key is then 400
    /// idempotency_error, as Stripe answers it). PREFIX=FORMAT sets it for paths starting
    /// with PREFIX (the longest matching prefix wins). Repeatable. Default: problem.
    #[arg(long = "error-format", value_name = "[PREFIX=]FORMAT")]
    pub error_format: Vec<String>,
    /// Trust this header (set by a gateway in front) to name the client, instead of an
    /// idem API key in Idem-Api-Key.
    #[arg(long)]
    pub principal_header: Option<String>,
    /// How to ask the upstream whether an UNKNOWN request took effect: a GET URL template
    /// where {key} is the Idempotency-Key the proxy sent the upstream, e.g.
    /// http://127.0.0.1:9000/charges?idempotency_key={key}. The proxy sends the client's
    /// key scoped by its tenant and principal, TENANT/PRINCIPAL/KEY (or sha256: and the
    /// hex digest of that when it is longer than 255 bytes), so two clients that pick the
    /// same key are two requests to an upstream that deduplicates by it.
    #[arg(long)]
    pub lookup_url: Option<String>,
    /// JSON pointer to the upstream's reference in the lookup's answer; nothing there (or
    /// a 404) means the request never took effect.
    #[arg(long, default_value = "/0/id")]
    pub lookup_found_pointer: String,
    /// "Not found" proves a request never took effect only this long after it (ms): the
    /// upstream may still be processing a request whose reply timed out.
    #[arg(long, default_value_t = 30_000)]
    pub lookup_absent_after_ms: u64,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RoleArg {
    Client,
    Operator,
    Admin,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret (only the secret, on stdout; shown only once).
    Create {
        #[command(flatten)]
        db: DbArgs,
        /// Tenant the key acts for (1-64 of [A-Za-z0-9._-]).
        #[arg(long)]
        tenant: String,
        /// What the key may do.
        #[arg(long, value_enum)]
        role: RoleArg,
        /// Principal recorded on every change made with the key (default: the role name).
        #[arg(long)]
        principal: Option<String>,
        /// Print {id, tenant, principal, role, secret} as JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// List keys (never their secrets).
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
        /// Print the keys as JSON (id, tenant, principal, role, created and revoked times).
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by id; it stops authenticating at once.
    Revoke {
        #[command(flatten)]
        db: DbArgs,
        /// The key's id (from `idem keys list`).
        #[arg(value_parser = path_segment)]
        id: String,
    },
}

/// The application's own database (not idem's ledger).
#[derive(Debug, Args)]
pub struct AppDbArgs {
    /// The application's database: `postgres://user@host:port/db` or `sqlite://PATH`.
    #[arg(long, env = "IDEM_APP_DATABASE_URL")]
    pub database_url: String,
}

#[derive(Debug, Args)]
pub struct RelayArgs {
    /// The configuration file with an [outbox] section (database_url, sinks).
    #[arg(long, env = "IDEM_CONFIG")]
    pub config: std::path::PathBuf,
    /// Serve GET /metrics (Prometheus) on this address, HOST:PORT: outbox lag, events by
    /// state, delivered/retried/dead by sink.
    #[arg(long, env = "IDEM_RELAY_LISTEN")]
    pub listen: Option<String>,
    /// Log format on stderr (level via RUST_LOG, default info).
    #[arg(long, env = "IDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// List events, newest first.
    List {
        #[command(flatten)]
        db: AppDbArgs,
        /// Only this state: PENDING, DELIVERED, DEAD (the dead letters) or SKIPPED.
        #[arg(long)]
        state: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=1000))]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Show one event and its attempts and operator actions.
    Get {
        #[command(flatten)]
        db: AppDbArgs,
        /// The event id.
        #[arg(value_parser = path_segment)]
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Deliver a dead letter again: one manual attempt (if it fails, it is dead again).
    Redrive(OperatorArgs),
    /// Do not deliver a dead letter: its aggregate's later events go on.
    Skip(OperatorArgs),
}

/// An operator's action on one dead letter.
#[derive(Debug, Args)]
pub struct OperatorArgs {
    #[command(flatten)]
    pub db: AppDbArgs,
    /// The event id.
    #[arg(value_parser = path_segment)]
    pub id: String,
    /// Why (mandatory, kept in the audit trail; at most 2000 bytes).
    #[arg(long)]
    pub reason: String,
    /// Who (default: $USER).
    #[arg(long, env = "USER", default_value = "operator")]
    pub operator: String,
}

#[derive(Debug, Subcommand)]
pub enum SchemaCommand {
    /// Create or upgrade the idem schema in the application's database: on PostgreSQL
    /// schema `idem` (tables inbox, outbox, outbox_attempts and the functions
    /// idem.outbox_append, idem.inbox_claim, idem.inbox_finish, idem.key_claim,
    /// idem.key_finish); on SQLite the idem_* tables. Versioned; running it again is a
    /// no-op. Prints the version.
    Install {
        #[command(flatten)]
        db: AppDbArgs,
    },
}

#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Base URL of the idem server.
    #[arg(long, env = "IDEM_URL", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// API key (Bearer): the one `idem serve` printed on first start, or one from `idem
    /// keys create`. Required (this flag or IDEM_API_KEY).
    #[arg(long, env = "IDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print the server's JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

impl ServerArgs {
    /// The API key from `--api-key` or `IDEM_API_KEY`.
    ///
    /// # Errors
    /// Neither is set (or it is empty): one line naming both and where keys come from.
    pub fn api_key(&self) -> anyhow::Result<String> {
        match self.api_key.as_deref().map(str::trim) {
            Some(k) if !k.is_empty() => Ok(k.to_owned()),
            _ => anyhow::bail!(
                "no API key: set IDEM_API_KEY (or pass --api-key) to the key `idem serve` printed on first start, or to one made with `idem keys create --tenant NAME --role client`"
            ),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum WfCommand {
    /// Start a workflow instance (or find it: the same instance id and input are the same
    /// instance). A declared workflow ([workflows.NAME] in the server's config) runs at once;
    /// give --steps to run the steps from your own code.
    Start {
        #[command(flatten)]
        server: ServerArgs,
        /// Workflow name.
        #[arg(value_parser = path_segment)]
        workflow: String,
        /// Stable business id of the instance, e.g. ORD-7:intake.
        #[arg(value_parser = path_segment)]
        instance_id: String,
        /// The input, as JSON text (default null).
        #[arg(long, conflicts_with = "input_file")]
        input: Option<String>,
        /// Read the input from a file (`-` for stdin).
        #[arg(long)]
        input_file: Option<std::path::PathBuf>,
        /// The event the instance comes from (e.g. a webhook's event id).
        #[arg(long)]
        source_event: Option<String>,
        /// Correlation / trace id.
        #[arg(long)]
        trace_id: Option<String>,
        /// Steps your code performs, in order, comma-separated (`create_order,notify`); each
        /// step's policy is manual. For a workflow not declared in the server's config.
        /// `GROUP:STEP` makes STEP a branch of parallel group GROUP (its key
        /// `{instance}:GROUP:STEP`): consecutive branches of one group may be acquired at once
        /// (`create_order,notify:email,notify:chat,close`).
        #[arg(long, value_delimiter = ',', value_parser = crate::wf::step_decl)]
        steps: Vec<serde_json::Value>,
        /// Settings of a parallel group of --steps, `GROUP:SETTING=VALUE,...` with
        /// `on_failure=pause|compensate` and `max_concurrency=N` (1-64; default: all at once),
        /// e.g. `notify:on_failure=compensate,max_concurrency=2`; repeat for several groups.
        /// They are part of the instance's definition, as its steps are.
        #[arg(long = "group", value_name = "GROUP:SETTINGS", requires = "steps", value_parser = crate::wf::group_decl)]
        groups: Vec<serde_json::Value>,
    },
    /// Re-run an instance (operator role), guarded: --dry-run prints exactly what it would do
    /// per step (kept, runs, redone under a new key, looked up first, compensated) and the
    /// plan's hash; a run with --plan-hash is refused if the instance changed since.
    Rerun {
        #[command(flatten)]
        server: ServerArgs,
        /// Instance id.
        #[arg(value_parser = path_segment)]
        instance_id: String,
        /// Why (mandatory for a run; kept in the instance's events with who asked).
        #[arg(long)]
        reason: Option<String>,
        /// A step to redo although it SUCCEEDED or is UNKNOWN (a new side effect under a new
        /// key; such a run needs --plan-hash); repeat for several. Without: continue from
        /// where the instance stopped.
        #[arg(long = "step")]
        steps: Vec<String>,
        /// Only show the plan; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// The hash of the plan you approved (from --dry-run); required when the run redoes
        /// a step that SUCCEEDED or is UNKNOWN.
        #[arg(long)]
        plan_hash: Option<String>,
    },
    /// Ask to compensate an instance (operator role): a FAILED one, or one PAUSED before
    /// any compensation; the compensations of its steps run, last step first.
    Compensate {
        #[command(flatten)]
        server: ServerArgs,
        /// Instance id.
        #[arg(value_parser = path_segment)]
        instance_id: String,
        /// Why (mandatory; kept in the instance's events with who asked).
        #[arg(long)]
        reason: String,
    },
    /// Show one instance: its steps (checkpoints), last good step and events.
    Get {
        #[command(flatten)]
        server: ServerArgs,
        /// Instance id.
        #[arg(value_parser = path_segment)]
        instance_id: String,
    },
    /// List instances, newest first.
    List {
        #[command(flatten)]
        server: ServerArgs,
        /// Only this state (RUNNING, SUCCEEDED, FAILED, PAUSED, COMPENSATING, COMPENSATED).
        #[arg(long)]
        state: Option<String>,
        /// Only this workflow.
        #[arg(long)]
        workflow: Option<String>,
        /// Only instances created at or after this instant (RFC 3339).
        #[arg(long)]
        created_after: Option<String>,
        /// Only instances created before this instant (RFC 3339).
        #[arg(long)]
        created_before: Option<String>,
        /// Page size (1-500).
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Continue after a previous page (its `more:` line).
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum OpsCommand {
    /// Show one operation with its event timeline.
    Get {
        #[command(flatten)]
        server: ServerArgs,
        /// Idempotency key.
        #[arg(value_parser = path_segment)]
        key: String,
    },
    /// List operations, newest first.
    List {
        #[command(flatten)]
        server: ServerArgs,
        /// Only this state (PENDING, EXECUTING, SUCCEEDED, FAILED, UNKNOWN).
        #[arg(long)]
        state: Option<String>,
        /// Only this action.
        #[arg(long)]
        action: Option<String>,
        /// Only operations flagged for review.
        #[arg(long)]
        needs_review: bool,
        /// Only keys starting with this (exact, case-sensitive).
        #[arg(long)]
        key_prefix: Option<String>,
        /// Only operations created at or after this instant (RFC 3339, e.g. 2026-11-30T12:00:00Z).
        #[arg(long)]
        created_after: Option<String>,
        /// Only operations created before this instant (RFC 3339).
        #[arg(long)]
        created_before: Option<String>,
        /// Page size (1-500).
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Cursor from the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Look an UNKNOWN operation up at its provider now and record the answer (operator).
    Reconcile {
        #[command(flatten)]
        server: ServerArgs,
        /// Idempotency key.
        #[arg(value_parser = path_segment)]
        key: String,
    },
    /// Resolve an operation by hand, with a reason (operator); SUCCEEDED needs --evidence.
    Resolve {
        #[command(flatten)]
        server: ServerArgs,
        /// Idempotency key.
        #[arg(value_parser = path_segment)]
        key: String,
        /// Target state.
        #[arg(long, value_enum)]
        to: ResolveTo,
        /// Why (recorded in the event log).
        #[arg(long)]
        reason: String,
        /// Evidence reference (the provider's id of the effect); required for succeeded.
        #[arg(long)]
        evidence: Option<String>,
        /// The state you decided from (e.g. UNKNOWN): if the operation is in another state
        /// now, nothing changes and the command fails (409 state-changed).
        #[arg(long)]
        expected_state: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ResolveTo {
    Succeeded,
    Pending,
    Failed,
}

#[derive(Debug, Args)]
pub struct AcquireArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Idempotency key, e.g. INQ-001:confirmation:v1.
    #[arg(value_parser = path_segment)]
    pub key: String,
    /// Action (kind of side effect), e.g. send_confirmation.
    #[arg(long)]
    pub action: String,
    /// Payload as JSON text. Refused: duplicate member names, and numbers an IEEE 754
    /// double does not carry exactly or beyond ±2^53 (1e-400, 4e-324: send them as
    /// strings). Its fingerprint reads text in NFC, so composed and decomposed forms match.
    #[arg(long, conflicts_with = "payload_file")]
    pub payload: Option<String>,
    /// Payload read from a JSON file (`-` for stdin).
    #[arg(long)]
    pub payload_file: Option<PathBuf>,
    /// JSON pointer of a field that defines the intent (repeatable); default: all.
    #[arg(long = "fingerprint-field")]
    pub fingerprint_fields: Vec<String>,
    /// Lease length in milliseconds.
    #[arg(long)]
    pub lease_ms: Option<i64>,
    /// Wait up to this many milliseconds for another worker's lease.
    #[arg(long)]
    pub wait_ms: Option<i64>,
    /// Declare the action safe to redo after an expired lease.
    #[arg(long)]
    pub redo_safe: bool,
    /// Let idem perform the side effect with this configured connector.
    #[arg(long)]
    pub connector: Option<String>,
    /// This attempt's lease holder identity: a UUID (version 4 or 7) made for this one
    /// attempt; default: a new one per call (printed with --json as `lease_holder`). Pass
    /// the same one only to resend this attempt after its answer was lost (the resend gets
    /// the same grant back while the lease is valid); never a worker name, an event id or
    /// a constant, which another run would share (refused).
    #[arg(long)]
    pub holder: Option<String>,
}

#[derive(Debug, Args)]
pub struct RenewArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Idempotency key.
    #[arg(value_parser = path_segment)]
    pub key: String,
    /// Fencing token from the acquire.
    #[arg(long)]
    pub token: i64,
    /// The lease then ends this many milliseconds from now (100-3600000; the server's
    /// default is 30000).
    #[arg(long)]
    pub lease_ms: Option<i64>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutcomeArg {
    Succeeded,
    RetryableFailure,
    FinalFailure,
    Unknown,
}

#[derive(Debug, Args)]
pub struct CompleteArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Idempotency key.
    #[arg(value_parser = path_segment)]
    pub key: String,
    /// Fencing token from the acquire.
    #[arg(long)]
    pub token: i64,
    /// What happened.
    #[arg(long, value_enum)]
    pub outcome: OutcomeArg,
    /// Provider's reference (required for succeeded).
    #[arg(long)]
    pub provider_ref: Option<String>,
    /// Result to store and replay, as JSON text (the payload's rules: no duplicate member
    /// names, numbers exact as IEEE 754 doubles).
    #[arg(long)]
    pub result: Option<String>,
    /// Error class (required for failures).
    #[arg(long)]
    pub error_class: Option<String>,
    /// Message.
    #[arg(long)]
    pub message: Option<String>,
    /// Provider's requested wait before the next attempt, in milliseconds.
    #[arg(long)]
    pub retry_after_ms: Option<i64>,
}
