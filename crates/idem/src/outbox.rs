//! `idem schema install`: the idem schema in an application's own database.

use crate::cli::SchemaCommand;
use crate::serve::redact;
use anyhow::Context;

pub async fn schema(cmd: SchemaCommand) -> anyhow::Result<()> {
    match cmd {
        SchemaCommand::Install { db } => {
            let url = &db.database_url;
            let done = idem_outbox::schema::install(url)
                .await
                .with_context(|| format!("cannot install the idem schema in {}", redact(url)))?;
            if done.from == done.to {
                crate::out!("idem: the idem schema is already at version {}", done.to);
            } else {
                crate::out!("idem: installed the idem schema, version {} (was {})", done.to, done.from);
            }
            Ok(())
        }
    }
}
