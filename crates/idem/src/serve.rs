//! `idem serve`: open the store (applying migrations), then run the HTTP server.

use crate::cli::{LogFormat, ServeArgs};
use anyhow::Context;
use idem_core::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;
use tracing_subscriber::EnvFilter;

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,tower_http=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    init_logging(args.log_format);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = idem_store::open(&args.db.database_url, clock.clone(), Default::default())
        .await
        .with_context(|| format!("cannot open the database {}", redact(&args.db.database_url)))?;
    let config = idem_server::ServerConfig {
        listen: args.listen,
        max_body_bytes: args.max_body_bytes,
        sweep_interval: Duration::from_millis(args.sweep_interval_ms),
        bootstrap_key: args.bootstrap_key,
    };
    idem_server::run(store, clock, config)
        .await
        .with_context(|| format!("cannot serve on {}", args.listen))
}

/// The URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}
