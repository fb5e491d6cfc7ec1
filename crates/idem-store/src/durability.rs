//! What the database promises about a commit idem acknowledges (issue 33): whether an
//! acknowledged claim survives the loss of the database's machine.
//!
//! On PostgreSQL that is two settings, as the database reports them to idem's sessions
//! (PostgreSQL docs, "Server Configuration: Replication", §20.6.2 and
//! `synchronous_commit` in §20.5.1): `synchronous_commit` (does `COMMIT` wait for the
//! local WAL flush, and for a standby?) and `synchronous_standby_names` (which standbys a
//! commit waits for; empty: none). A commit acknowledged while they name a standby and
//! `synchronous_commit` is `on` or `remote_apply` is on that standby's disk too, so a
//! failover to it loses nothing acknowledged; `remote_write` has it in the standby's
//! memory (lost only if both machines fail at once). Anything else leaves the only copy
//! on the primary: a failover to an asynchronous standby can lose the last acknowledged
//! claims.

/// How far an acknowledged commit is kept (weakest first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Not even flushed on the database's own disk before the answer
    /// (`synchronous_commit = off`): a crash of the database loses the last commits.
    Unflushed,
    /// On the database's own disk (SQLite's fsync before every answer; PostgreSQL without
    /// a synchronous standby, or `synchronous_commit = local`).
    Local,
    /// On a synchronous standby too (written to its memory at least: `remote_write`).
    Replicated,
}

impl Level {
    /// The level's name in `/metrics` and logs: `unflushed`, `local`, `replicated`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Unflushed => "unflushed",
            Level::Local => "local",
            Level::Replicated => "replicated",
        }
    }
}

/// The database's promise, as read from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitDurability {
    /// `synchronous_commit` of idem's sessions (PostgreSQL), as `SHOW` prints it.
    pub synchronous_commit: Option<String>,
    /// `synchronous_standby_names` (PostgreSQL), as `SHOW` prints it; empty: no standby.
    pub synchronous_standby_names: Option<String>,
    /// `host:port` of the server idem writes to (PostgreSQL).
    pub primary: Option<String>,
    /// How many hosts the database URL names (1 for one server or SQLite).
    pub hosts: usize,
}

impl CommitDurability {
    /// SQLite: idem fsyncs the write-ahead log before every answer.
    pub fn sqlite() -> Self {
        CommitDurability { synchronous_commit: None, synchronous_standby_names: None, primary: None, hosts: 1 }
    }

    /// How far an acknowledged commit is kept.
    pub fn level(&self) -> Level {
        let Some(commit) = self.synchronous_commit.as_deref() else { return Level::Local };
        let standbys = self.synchronous_standby_names.as_deref().is_some_and(|s| !s.trim().is_empty());
        match commit {
            "off" => Level::Unflushed,
            "on" | "remote_apply" | "remote_write" if standbys => Level::Replicated,
            _ => Level::Local,
        }
    }

    /// One line for logs and `/readyz`: the settings and what they mean.
    pub fn describe(&self) -> String {
        let meaning = match self.level() {
            Level::Replicated => "an acknowledged commit is on a synchronous standby too: a failover to it loses none",
            Level::Local if self.synchronous_commit.is_none() => {
                "SQLite: the write-ahead log is fsynced before every answer"
            }
            Level::Local => {
                "no synchronous standby: an acknowledged commit is only on the primary, and a failover can lose the last ones"
            }
            Level::Unflushed => {
                "commits are acknowledged before they are on disk: a crash of the database can lose the last ones"
            }
        };
        match (&self.synchronous_commit, &self.synchronous_standby_names) {
            (Some(c), Some(s)) => {
                let on = self.primary.as_deref().map(|p| format!(" on {p}")).unwrap_or_default();
                format!("synchronous_commit={c} synchronous_standby_names='{s}'{on}: {meaning}")
            }
            _ => meaning.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(commit: &str, standbys: &str) -> CommitDurability {
        CommitDurability {
            synchronous_commit: Some(commit.into()),
            synchronous_standby_names: Some(standbys.into()),
            primary: Some("db1:5432".into()),
            hosts: 2,
        }
    }

    #[test]
    fn only_a_synchronous_standby_with_a_waiting_commit_is_replicated() {
        for c in ["on", "remote_apply", "remote_write"] {
            assert_eq!(pg(c, "ANY 1 (pgautofailover_standby_2)").level(), Level::Replicated, "{c}");
            assert_eq!(pg(c, "*").level(), Level::Replicated, "{c}");
            assert_eq!(pg(c, "").level(), Level::Local, "{c} without standbys");
            assert_eq!(pg(c, "  ").level(), Level::Local, "{c} with blank standbys");
        }
        assert_eq!(pg("local", "s2").level(), Level::Local);
        assert_eq!(pg("off", "s2").level(), Level::Unflushed);
        assert_eq!(CommitDurability::sqlite().level(), Level::Local);
    }

    #[test]
    fn the_description_names_the_settings_and_the_primary() {
        let d = pg("on", "ANY 1 (s2)").describe();
        assert!(d.starts_with("synchronous_commit=on synchronous_standby_names='ANY 1 (s2)' on db1:5432: "), "{d}");
        assert!(d.contains("loses none"), "{d}");
        assert!(pg("on", "").describe().contains("can lose the last ones"));
        assert!(CommitDurability::sqlite().describe().contains("fsynced"));
    }
}
