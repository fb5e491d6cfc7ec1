//! The book's pages (`docs/src/**/*.md`) and README.md as a test reads them: their fenced
//! code blocks, each with the annotation on the line before it.
//!
//! The convention (checked by `tests/docs.rs`): the last non-blank line before every
//! fence is an HTML comment `<!-- snippet: KIND key=value key="a value" … -->`, which a
//! rendered page does not show. KIND is one of
//! - `run`: the block runs. `sh` blocks are appended, in page order, to one bash script
//!   per page (`set -euo pipefail`, run as a whole, as a reader pastes it); a `python`
//!   block is run with Debian's `/usr/bin/python3` at that point of the script, a `js`
//!   block with `node` (with `file=NAME` either is only saved under that name, for the
//!   page's own commands to run); a `sql` block runs through
//!   `psql "$DATABASE_URL"` there. Options, for the page: `server=sqlite` (the test
//!   starts `idem serve` on a fresh SQLite file and reads the key it prints on first
//!   start, as a reader does), `database=NAME` (the page creates a PostgreSQL database
//!   NAME: the test gives it a unique name and drops it afterwards). `expect="TEXT"` (or
//!   `"A|B"`): the page's output must contain it — with the statuses of `# HTTP/1.1 NNN`
//!   comments, which must be the ones printed, what makes a page that runs but does the
//!   wrong thing fail. `overlap=N` (an `sh` block): the block runs as N copies at once in
//!   the page's directory, each in a subshell, each one's exit status checked — two
//!   overlapping runs of a scheduled job, which must not share state through a file;
//! - `config`: a whole configuration file, saved as `file=NAME` in the page's directory
//!   (so later `run` blocks can use it), parsed as TOML and checked with
//!   `idem serve --check-config`;
//! - `fragment`: an excerpt of a configuration file: parsed as TOML only;
//! - `in-test file=PATH`: a Rust excerpt whose lines appear, in order, in PATH (a doc
//!   test or test that `cargo test` compiles);
//! - `output`: what a command prints, or a transcript: never run;
//! - `text`: not code — a diagram: nothing to run;
//! - `skip reason="…"`: not run, for the reason given (required).
//!
//! A fence without an annotation fails `tests/docs.rs`: no new snippet slips in untested.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// README.md and every page under docs/src, sorted.
pub fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let root = root();
    let mut out = vec![root.join("README.md")];
    walk(&root.join("docs/src"), &mut out);
    out.sort();
    out
}

/// A page's path relative to the repository's root, for messages.
pub fn rel(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

/// One fenced code block.
#[derive(Debug, Clone)]
pub struct Block {
    pub page: PathBuf,
    /// 1-based line of the opening fence.
    pub line: usize,
    /// The fence's info string's first word (`sh`, `python`, `toml`, …; empty if none).
    pub lang: String,
    pub text: String,
    /// KIND and options of its annotation; `None` when the line before has none.
    pub kind: Option<String>,
    pub opts: BTreeMap<String, String>,
}

impl Block {
    /// `page:line`, for messages.
    pub fn at(&self) -> String {
        format!("{}:{}", rel(&self.page), self.line)
    }
}

/// Parses `KIND key=value key="quoted value"` (the inside of `<!-- snippet: … -->`); in a
/// quoted value `\"`, `\n` and `\\` stand for a quote, a newline and a backslash.
pub fn parse_annotation(inner: &str) -> (String, BTreeMap<String, String>) {
    let mut words = Vec::new();
    let (mut cur, mut quoted) = (String::new(), false);
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            // In a quoted value: \" is a quote, \n a newline, \\ a backslash.
            '\\' if quoted => match chars.next() {
                Some('n') => cur.push('\n'),
                Some(e) => cur.push(e),
                None => {}
            },
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    let kind = words.first().cloned().unwrap_or_default();
    let opts = words[1.min(words.len())..]
        .iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (w.clone(), String::new()),
        })
        .collect();
    (kind, opts)
}

/// Every fenced block of a page (``` or ~~~ fences, at most three spaces of indent).
pub fn blocks(page: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(page).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        let indent = lines[i].len() - trimmed.len();
        let fence = if trimmed.starts_with("```") {
            "```"
        } else if trimmed.starts_with("~~~") {
            "~~~"
        } else {
            ""
        };
        if fence.is_empty() || indent > 3 {
            i += 1;
            continue;
        }
        let lang = trimmed.trim_start_matches(fence).split([' ', ',', '{']).next().unwrap_or("").trim().to_owned();
        let open = i;
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && !lines[i].trim_start().starts_with(fence) {
            body.push(lines[i]);
            i += 1;
        }
        i += 1;
        let before = lines[..open].iter().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim());
        let annotation = before
            .and_then(|l| l.strip_prefix("<!-- snippet:"))
            .and_then(|l| l.strip_suffix("-->"))
            .map(parse_annotation);
        let (kind, opts) = match annotation {
            Some((k, o)) => (Some(k), o),
            None => (None, BTreeMap::new()),
        };
        out.push(Block { page: page.to_owned(), line: open + 1, lang, text: body.join("\n"), kind, opts });
    }
    out
}

/// The block of `page` (relative to the repository's root) whose annotation has
/// `name=NAME`: what a test that runs one block in its own way reads.
pub fn named(page: &str, name: &str) -> String {
    let path = root().join(page);
    blocks(&path)
        .into_iter()
        .find(|b| b.opts.get("name").map(String::as_str) == Some(name))
        .unwrap_or_else(|| panic!("no block with name={name} in {page}"))
        .text
}

/// The id mdBook gives a heading (mdbook-html's `id_from_content`, applied to the text
/// the heading shows: code spans without their backticks, links as their text).
pub fn heading_id(heading: &str) -> String {
    let mut shown = String::new();
    let mut rest = heading;
    while let Some(i) = rest.find('[') {
        shown.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match (after.find("]("), after.find(')')) {
            (Some(j), Some(k)) if j < k => {
                shown.push_str(&after[..j]);
                rest = &after[k + 1..];
            }
            _ => {
                shown.push('[');
                rest = after;
            }
        }
    }
    shown.push_str(rest);
    shown
        .replace('`', "")
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c)
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The ids of a page's headings, as mdBook makes them unique (`-1`, `-2` for repeats).
pub fn heading_ids(text: &str) -> Vec<String> {
    let mut used = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence || !t.starts_with('#') {
            continue;
        }
        let hashes = t.chars().take_while(|c| *c == '#').count();
        if hashes > 6 || !t[hashes..].starts_with(' ') {
            continue;
        }
        let base = heading_id(&t[hashes..]);
        let mut id = base.clone();
        let mut n = 0;
        while !used.insert(id.clone()) {
            n += 1;
            id = format!("{base}-{n}");
        }
        out.push(id);
    }
    out
}

/// An `idem serve` started as a reader starts it the first time — on a fresh SQLite file
/// in `dir`, no bootstrap key — with the port it listens on and the admin key it printed.
/// Killed when dropped.
pub struct FirstStart {
    child: std::process::Child,
    pub port: u16,
    pub key: String,
}

impl FirstStart {
    pub fn new(dir: &Path) -> FirstStart {
        use std::io::BufRead;
        let mut child = std::process::Command::new(super::idem_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
            .arg(format!("sqlite://{}", dir.join("idem.db").display()))
            .env_remove("IDEM_BOOTSTRAP_KEY")
            .env("RUST_LOG", "warn")
            .current_dir(dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (mut key, mut port) = (None, None);
        for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            if let Some(k) = line.strip_prefix("idem: IDEM_API_KEY=") {
                key = Some(k.to_owned());
            }
            if let Some(b) = line.strip_prefix("idem: listening on http://") {
                port = b.rsplit(':').next().and_then(|p| p.parse().ok());
                break;
            }
        }
        FirstStart { child, port: port.expect("the server's port"), key: key.expect("the key printed on first start") }
    }
}

impl Drop for FirstStart {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Drops a PostgreSQL database a page or test created when it ends, also when it failed.
pub struct DropDatabase(pub String);

impl Drop for DropDatabase {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                &idem_store::testing::pg_admin_url(),
                "-qc",
                &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.0),
            ])
            .output();
    }
}
