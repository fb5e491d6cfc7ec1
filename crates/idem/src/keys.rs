//! `idem keys …`: API key management, directly against the database (the server may be
//! running; SQLite writers wait on each other, PostgreSQL serves both).

use crate::cli::{KeysCommand, RoleArg};
use crate::serve::redact;
use anyhow::Context;
use idem_core::SystemClock;
use idem_store::keys::Role;
use std::sync::Arc;

async fn open(url: &str) -> anyhow::Result<Arc<dyn idem_store::Store>> {
    let config = idem_store::StoreConfig { must_exist: true, ..Default::default() };
    idem_store::open(url, Arc::new(SystemClock), config)
        .await
        .with_context(|| format!("cannot open the database {}", redact(url)))
}

fn role(r: RoleArg) -> Role {
    match r {
        RoleArg::Client => Role::Client,
        RoleArg::Operator => Role::Operator,
        RoleArg::Admin => Role::Admin,
    }
}

pub async fn run(cmd: KeysCommand) -> anyhow::Result<()> {
    match cmd {
        KeysCommand::Create { db, tenant, role: r, principal, json } => {
            let store = open(&db.database_url).await?;
            let role = role(r);
            let principal = principal.unwrap_or_else(|| role.as_str().to_owned());
            let (info, secret) = store.create_api_key(&tenant, &principal, role, None).await?;
            if json {
                let mut v = serde_json::to_value(&info)?;
                v["secret"] = secret.into();
                crate::out!("{v}");
            } else {
                crate::out!("{secret}");
                eprintln!(
                    "idem: created key {} for tenant {tenant} ({role}); the secret above is shown only once",
                    info.id
                );
            }
        }
        KeysCommand::List { db, tenant, json } => {
            let store = open(&db.database_url).await?;
            let keys = store.list_api_keys(tenant.as_deref()).await?;
            if json {
                crate::out!("{}", serde_json::to_string(&keys)?);
            } else {
                crate::out!("{:<36}  {:<16}  {:<16}  {:<8}  STATUS", "ID", "TENANT", "PRINCIPAL", "ROLE");
                for k in keys {
                    let status = if k.revoked_at.is_some() { "revoked" } else { "active" };
                    crate::out!("{:<36}  {:<16}  {:<16}  {:<8}  {status}", k.id, k.tenant, k.principal, k.role);
                }
            }
        }
        KeysCommand::Revoke { db, id } => {
            let store = open(&db.database_url).await?;
            if !store.revoke_api_key(&id).await? {
                anyhow::bail!("no active key with id {id}");
            }
            crate::out!("revoked {id}");
        }
    }
    Ok(())
}
