//! The guard's configuration file (`idem mcp --config guard.toml`), in idem.toml's style.
//!
//! ```toml
//! server = "tickets"          # the server's name in operation keys (default: its serverInfo.name)
//! tenant = "default"          # the ledger tenant guarded calls are kept in
//! lookup_interval_ms = 1000   # how often unknown calls with a lookup tool are looked up
//!
//! [defaults]                  # every guarded tool, unless its own table says otherwise
//! timeout_ms = 30000          # waiting for the server's answer; after it the outcome is UNKNOWN
//! wait_ms = 5000              # a repeat of a running call waits this long for it to finish
//! tool_error = "final"        # an answer with isError: true is "final" (FAILED) or "retryable"
//! max_argument_bytes = 262144 # larger arguments are refused, nothing recorded or sent
//!
//! [tools.create_ticket]
//! guard = true                # true | false (pass through); default: false only for readOnlyHint
//! intent = ["customer", "/order/id"]  # argument fields that name the intent (default: all)
//! idempotency_key_argument = "request_id"  # filled with the operation key before sending
//! lease_ms = 40000            # default timeout_ms + 10000
//! lookup = { tool = "find_ticket", arguments = { request_id = "{idempotency_key}" },
//!            evidence_pointer = "/structuredContent/id", max_lookups = 5, absent_after_ms = 30000 }
//! ```
//!
//! Every error names the field it is about (`tools.create_ticket.intent[1]: …`).

use idem_connect::ConfigError;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Default [`ToolConfig::timeout_ms`]: 30 s.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// Default [`ToolConfig::wait_ms`]: 5 s.
pub const DEFAULT_WAIT_MS: u64 = 5_000;
/// Default largest arguments object (its JSON text, bytes): 256 KiB.
pub const DEFAULT_MAX_ARGUMENT_BYTES: usize = 262_144;
/// The lease is the timeout plus this much (ms), so a live call never outlives its lease.
pub const LEASE_MARGIN_MS: u64 = 10_000;

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

/// What an answer with `isError: true` means for the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ToolErrorIs {
    /// FAILED: the answer is kept and replayed; the tool is not called again for the intent.
    #[default]
    Final,
    /// Nothing happened: the answer is passed on and the next identical call is sent again.
    Retryable,
}

/// The file as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    server: Option<String>,
    tenant: Option<String>,
    lookup_interval_ms: Option<u64>,
    #[serde(default)]
    defaults: ToolFile,
    #[serde(default)]
    tools: BTreeMap<String, ToolFile>,
}

/// One `[tools.NAME]` (or `[defaults]`) table as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolFile {
    guard: Option<bool>,
    intent: Option<Vec<String>>,
    idempotency_key_argument: Option<String>,
    timeout_ms: Option<u64>,
    lease_ms: Option<u64>,
    wait_ms: Option<u64>,
    tool_error: Option<ToolErrorIs>,
    max_argument_bytes: Option<usize>,
    lookup: Option<LookupFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LookupFile {
    tool: String,
    #[serde(default)]
    arguments: Map<String, Value>,
    evidence_pointer: String,
    max_lookups: Option<i64>,
    absent_after_ms: Option<i64>,
}

/// How one tool is guarded (its table over `[defaults]` over the built-in defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolConfig {
    /// `Some(true)`: guarded; `Some(false)`: passed through; `None`: by the tool's
    /// `readOnlyHint` (passed through only when it is `true`).
    pub guard: Option<bool>,
    /// JSON pointers (RFC 6901) of the arguments that name the intent; `None` = all
    /// arguments. A top-level name `customer` is written as `/customer`.
    pub intent: Option<Vec<String>>,
    /// An argument the guard sets to the operation key before sending, for servers that
    /// deduplicate by it; it is left out of the key and the fingerprint.
    pub idempotency_key_argument: Option<String>,
    /// Waiting for the server's answer (ms); after it the outcome is UNKNOWN.
    pub timeout_ms: u64,
    /// The lease the guard holds while the call runs (ms); above `timeout_ms`.
    pub lease_ms: u64,
    /// How long a repeat of a running call waits for it to finish (ms, 0–30 000).
    pub wait_ms: u64,
    /// What `isError: true` means.
    pub tool_error: ToolErrorIs,
    /// Largest arguments object (bytes of its JSON text).
    pub max_argument_bytes: usize,
    /// The lookup tool that settles an unknown outcome, if any.
    pub lookup: Option<LookupConfig>,
}

impl Default for ToolConfig {
    fn default() -> Self {
        ToolConfig {
            guard: None,
            intent: None,
            idempotency_key_argument: None,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            lease_ms: DEFAULT_TIMEOUT_MS + LEASE_MARGIN_MS,
            wait_ms: DEFAULT_WAIT_MS,
            tool_error: ToolErrorIs::Final,
            max_argument_bytes: DEFAULT_MAX_ARGUMENT_BYTES,
            lookup: None,
        }
    }
}

/// A lookup tool of the same server: called with `arguments` (every string `{idempotency_key}`
/// replaced by the operation key, `{task_id}` by the task id, and a string that is exactly
/// `{arguments.NAME}` by that argument's value), its result read at `evidence_pointer`.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupConfig {
    /// The tool's name.
    pub tool: String,
    /// The arguments template.
    pub arguments: Map<String, Value>,
    /// JSON pointer (RFC 6901) into the lookup's CallToolResult (`/structuredContent/id`):
    /// a non-empty string or a number there is the evidence (found); `null`, `[]` or `""`
    /// there is absence (once `absent_after_ms` has passed); a missing member, a tool error or
    /// anything else is inconclusive, so a wrong pointer sends calls to review, never to a
    /// second attempt.
    pub evidence_pointer: String,
    /// Inconclusive lookups before the operation is flagged for review.
    pub max_lookups: i64,
    /// Absence proves nothing until this long after the call (ms; default 30 000): a server
    /// that timed out may still be working on it.
    pub absent_after_ms: i64,
}

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuardConfig {
    /// The server's name in keys; `None` = its `serverInfo.name`.
    pub server: Option<String>,
    /// The ledger tenant (default `default`).
    pub tenant: String,
    /// How often unknown calls are looked up (ms).
    pub lookup_interval_ms: u64,
    /// `[defaults]` resolved.
    pub defaults: ToolConfig,
    /// `[tools.NAME]` resolved over the defaults.
    pub tools: BTreeMap<String, ToolConfig>,
}

/// The tenant guarded calls are kept in when the file names none: the first start's admin
/// key's tenant, so an operator sees them in `/ui` without another key.
pub const DEFAULT_TENANT: &str = "default";

impl GuardConfig {
    /// Reads and checks the file at `path`.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (or `file` when it cannot be read).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| err("file", format!("{}: {e}", path.display())))?;
        Self::parse(&text)
    }

    /// Parses and checks a file's text.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| err("file", e.message().to_owned()))?;
        let file: File = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            err(if field == "." { "file".into() } else { field }, e.inner().message().to_owned())
        })?;
        let defaults = resolve("defaults", &file.defaults, &ToolConfig::default())?;
        if defaults.lookup.is_some() || defaults.intent.is_some() || defaults.idempotency_key_argument.is_some() {
            return Err(err(
                "defaults",
                "intent, idempotency_key_argument and lookup are set per tool, not in [defaults]",
            ));
        }
        let mut tools = BTreeMap::new();
        for (name, t) in &file.tools {
            tools.insert(name.clone(), resolve(&format!("tools.{name}"), t, &defaults)?);
        }
        if let Some(s) = &file.server {
            check_server_name(s).map_err(|m| err("server", m))?;
        }
        let tenant = file.tenant.clone().unwrap_or_else(|| DEFAULT_TENANT.into());
        idem_store::keys::validate_name("tenant", &tenant).map_err(|m| err("tenant", m))?;
        let lookup_interval_ms = file.lookup_interval_ms.unwrap_or(1_000);
        if !(100..=3_600_000).contains(&lookup_interval_ms) {
            return Err(err("lookup_interval_ms", "must be 100-3600000 (ms)"));
        }
        Ok(GuardConfig { server: file.server, tenant, lookup_interval_ms, defaults, tools })
    }

    /// The configuration of tool `name` (its table, or the defaults).
    pub fn tool(&self, name: &str) -> &ToolConfig {
        self.tools.get(name).unwrap_or(&self.defaults)
    }

    /// Whether a call of `name` is guarded, given the tool's `readOnlyHint` (MCP 2025-06-18
    /// §Tool annotations: hints, untrusted; the file overrides them).
    pub fn guarded(&self, name: &str, read_only_hint: Option<bool>) -> bool {
        self.tool(name).guard.unwrap_or(read_only_hint != Some(true))
    }
}

/// A server name fit for an operation key: 1–64 of `[A-Za-z0-9._-]`.
///
/// # Errors
/// What is wrong, in words.
pub fn check_server_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 64 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("{s:?}: a server name is 1-64 characters of A-Z a-z 0-9 . _ -"));
    }
    Ok(())
}

fn resolve(at: &str, t: &ToolFile, base: &ToolConfig) -> Result<ToolConfig, ConfigError> {
    let timeout_ms = t.timeout_ms.unwrap_or(base.timeout_ms);
    if !(1..=3_600_000).contains(&timeout_ms) {
        return Err(err(format!("{at}.timeout_ms"), "must be 1-3600000 (ms)"));
    }
    let lease_ms = match t.lease_ms {
        Some(l) if l <= timeout_ms => {
            return Err(err(
                format!("{at}.lease_ms"),
                format!(
                    "must exceed timeout_ms ({timeout_ms}): a lease that ends under a live call would make it UNKNOWN"
                ),
            ));
        }
        Some(l) if l > idem_core::decision::MAX_LEASE_MS as u64 => {
            return Err(err(format!("{at}.lease_ms"), "must be at most 3600000 (ms)"));
        }
        Some(l) => l,
        None if t.timeout_ms.is_some() => timeout_ms + LEASE_MARGIN_MS,
        None => base.lease_ms.max(timeout_ms + 1),
    };
    let wait_ms = t.wait_ms.unwrap_or(base.wait_ms);
    if wait_ms > 30_000 {
        return Err(err(format!("{at}.wait_ms"), "must be 0-30000 (ms)"));
    }
    let max_argument_bytes = t.max_argument_bytes.unwrap_or(base.max_argument_bytes);
    if !(1..=16 * 1024 * 1024).contains(&max_argument_bytes) {
        return Err(err(format!("{at}.max_argument_bytes"), "must be 1-16777216 (bytes)"));
    }
    let intent = match &t.intent {
        None => base.intent.clone(),
        Some(list) if list.is_empty() => {
            return Err(err(format!("{at}.intent"), "name at least one argument (or leave it out: all arguments)"));
        }
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, f) in list.iter().enumerate() {
                let p = if f.starts_with('/') {
                    f.clone()
                } else {
                    format!("/{}", f.replace('~', "~0").replace('/', "~1"))
                };
                if f.is_empty() || out.contains(&p) {
                    return Err(err(format!("{at}.intent[{i}]"), format!("{f:?} is empty or named twice")));
                }
                out.push(p);
            }
            Some(out)
        }
    };
    let lookup = match &t.lookup {
        None => None,
        Some(l) => {
            if l.tool.is_empty() {
                return Err(err(format!("{at}.lookup.tool"), "name the lookup tool"));
            }
            if !l.evidence_pointer.starts_with('/') {
                return Err(err(
                    format!("{at}.lookup.evidence_pointer"),
                    "must be a JSON pointer into the lookup's result, e.g. /structuredContent/id",
                ));
            }
            let max_lookups = l.max_lookups.unwrap_or(5);
            if !(1..=100).contains(&max_lookups) {
                return Err(err(format!("{at}.lookup.max_lookups"), "must be 1-100"));
            }
            let absent_after_ms = l.absent_after_ms.unwrap_or(30_000);
            if !(0..=86_400_000).contains(&absent_after_ms) {
                return Err(err(format!("{at}.lookup.absent_after_ms"), "must be 0-86400000 (ms)"));
            }
            Some(LookupConfig {
                tool: l.tool.clone(),
                arguments: l.arguments.clone(),
                evidence_pointer: l.evidence_pointer.clone(),
                max_lookups,
                absent_after_ms,
            })
        }
    };
    if t.idempotency_key_argument.as_deref() == Some("") {
        return Err(err(format!("{at}.idempotency_key_argument"), "must name an argument"));
    }
    Ok(ToolConfig {
        guard: t.guard.or(base.guard),
        intent,
        idempotency_key_argument: t.idempotency_key_argument.clone().or_else(|| base.idempotency_key_argument.clone()),
        timeout_ms,
        lease_ms,
        wait_ms,
        tool_error: t.tool_error.unwrap_or(base.tool_error),
        max_argument_bytes,
        lookup,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_file_parses_and_tools_fall_back_to_defaults() {
        let text = r#"
server = "tickets"
[defaults]
timeout_ms = 2000
tool_error = "retryable"
[tools.create_ticket]
intent = ["customer", "/order/id"]
idempotency_key_argument = "request_id"
lookup = { tool = "find_ticket", arguments = { request_id = "{idempotency_key}" }, evidence_pointer = "/structuredContent/id" }
[tools.count_tickets]
guard = true
"#;
        let c = GuardConfig::parse(text).unwrap();
        assert_eq!(c.tenant, "default");
        let t = c.tool("create_ticket");
        assert_eq!(t.intent.as_deref(), Some(&["/customer".to_owned(), "/order/id".to_owned()][..]));
        assert_eq!((t.timeout_ms, t.lease_ms, t.tool_error), (2000, 12_000, ToolErrorIs::Retryable));
        assert_eq!(t.lookup.as_ref().unwrap().max_lookups, 5);
        assert_eq!(c.tool("other").timeout_ms, 2000);
        assert!(c.guarded("count_tickets", Some(true)), "the file overrides the hint");
        assert!(!c.guarded("other", Some(true)) && c.guarded("other", None) && c.guarded("other", Some(false)));
    }

    #[test]
    fn errors_name_the_field() {
        for (text, field) in [
            ("[tools.a]\nlease_ms = 10\ntimeout_ms = 20", "tools.a.lease_ms"),
            ("[tools.a]\nintent = []", "tools.a.intent"),
            ("[tools.a]\nintent = [\"x\", \"/x\"]", "tools.a.intent[1]"),
            ("[tools.a]\nwait_ms = 40000", "tools.a.wait_ms"),
            ("[tools.a]\nlookup = { tool = \"f\", evidence_pointer = \"id\" }", "tools.a.lookup.evidence_pointer"),
            ("[tools.a]\nbogus = 1", "tools.a.bogus"),
            ("[tools.a]\ntool_error = \"maybe\"", "tools.a.tool_error"),
            ("server = \"a b\"", "server"),
            ("tenant = \" x\"", "tenant"),
            ("[defaults]\nintent = [\"a\"]", "defaults"),
        ] {
            let e = GuardConfig::parse(text).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
        }
    }
}

#[cfg(test)]
mod readme_tests {
    /// The book's guard.toml (docs/src/guides/ai-agents-mcp.md) is a file the guard takes as it is.
    #[test]
    fn the_readme_guard_file_parses() {
        let readme = include_str!("../../../docs/src/guides/ai-agents-mcp.md");
        let start = readme.find("# guard.toml\n").expect("the book's MCP page shows guard.toml");
        let block = &readme[start..];
        let block = &block[..block.find("```").expect("the block ends")];
        let c = super::GuardConfig::parse(block).unwrap_or_else(|e| panic!("{e}\n{block}"));
        let t = c.tool("create_ticket");
        assert_eq!(t.lookup.as_ref().map(|l| l.tool.as_str()), Some("find_ticket"));
        assert_eq!((t.lease_ms, c.server.as_deref()), (40_000, Some("tickets")));
    }
}
