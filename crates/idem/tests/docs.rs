//! The book (`docs/src`) and README.md, tested (issue 32): every fenced block carries an
//! annotation (`tests/common/book.rs` has the convention) and is run, checked or
//! explicitly skipped with a reason; configuration files pass `idem serve --check-config`;
//! links and anchors resolve; the generated reference pages match the code; the README
//! stays short.
//!
//! Each page's `run` blocks are one bash script, run as a whole in a directory of its own
//! (`set -euo pipefail`, as a reader pastes them), against real servers: an `idem serve`
//! the test starts when the page asks for one, a PostgreSQL database when it creates one,
//! Debian's python3 with psycopg, psql. Pages run concurrently. What the test changes in a
//! block before it runs it, and nothing else: every loopback port the page names (but
//! PostgreSQL's 5432 and NATS's 4222) becomes a free one — 8080 the started server's —, an
//! `idem_…` key placeholder the key that server printed on its first start, a database the
//! page creates a unique name, and `${CARGO_TARGET_DIR:-$PWD/target}/release` (or
//! `target/release`) this build's directory of the `idem` binary, which is also on PATH.

mod common;

use common::book::{self, Block};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KINDS: [&str; 7] = ["run", "config", "fragment", "in-test", "output", "text", "skip"];

fn all_blocks() -> Vec<Block> {
    book::pages().iter().flat_map(|p| book::blocks(p)).collect()
}

#[test]
fn every_block_is_annotated() {
    let mut errors = Vec::new();
    let blocks = all_blocks();
    for b in &blocks {
        let Some(kind) = &b.kind else {
            errors.push(format!(
                "{}: a ```{} block without `<!-- snippet: KIND … -->` on the line before (run, config, fragment, in-test, output, text, skip reason=\"…\"; see crates/idem/tests/common/book.rs)",
                b.at(),
                b.lang
            ));
            continue;
        };
        if !KINDS.contains(&kind.as_str()) {
            errors.push(format!("{}: unknown snippet kind {kind:?}", b.at()));
        }
        match kind.as_str() {
            "skip" if b.opts.get("reason").is_none_or(|r| r.trim().len() < 10) => {
                errors.push(format!("{}: `skip` needs reason=\"…\" saying why it cannot run", b.at()))
            }
            "run" if !["sh", "bash", "python", "sql", "js"].contains(&b.lang.as_str()) => {
                errors.push(format!("{}: `run` takes sh, bash, python, js or sql blocks, not {:?}", b.at(), b.lang))
            }
            "run"
                if b.opts.get("overlap").is_some_and(|n| {
                    !["sh", "bash"].contains(&b.lang.as_str()) || !n.parse::<usize>().is_ok_and(|n| n >= 2)
                }) =>
            {
                errors.push(format!("{}: `overlap=N` takes an sh or bash block and N of 2 or more", b.at()))
            }
            "config" if b.lang != "toml" || !b.opts.contains_key("file") => {
                errors.push(format!("{}: `config` is a ```toml block with file=NAME", b.at()))
            }
            "fragment" if b.lang != "toml" => errors.push(format!("{}: `fragment` is a ```toml block", b.at())),
            "in-test" if !b.opts.contains_key("file") => {
                errors.push(format!("{}: `in-test` needs file=PATH of the test that compiles it", b.at()))
            }
            _ => {}
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    let runs = blocks.iter().filter(|b| b.kind.as_deref() == Some("run")).count();
    assert!(runs >= 20, "only {runs} runnable blocks found: is the book there?");
    eprintln!(
        "{} blocks: {}",
        blocks.len(),
        KINDS
            .iter()
            .map(|k| format!("{} {k}", blocks.iter().filter(|b| b.kind.as_deref() == Some(*k)).count()))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// Every `{ env = "NAME" }` a configuration names: set to a placeholder when unset, so the
/// check sees a complete file (what the reader's environment would hold).
fn env_names(toml: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = toml;
    while let Some(i) = rest.find("env = \"") {
        let after = &rest[i + 7..];
        if let Some(j) = after.find('"') {
            out.insert(after[..j].to_owned());
        }
        rest = &after[1..];
    }
    out
}

#[test]
fn configuration_snippets_parse_and_pass_the_start_checks() {
    let mut errors = Vec::new();
    let mut checked = 0;
    for b in all_blocks() {
        let kind = b.kind.as_deref().unwrap_or("");
        if kind != "config" && kind != "fragment" {
            continue;
        }
        if let Err(e) = b.text.parse::<toml::Table>() {
            errors.push(format!("{}: not TOML: {e}", b.at()));
            continue;
        }
        if kind == "fragment" {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(&b.opts["file"]);
        std::fs::write(&file, &b.text).unwrap();
        let mut cmd = Command::new(common::idem_bin());
        cmd.args(["serve", "--check-config", "--config"]).arg(&file).current_dir(dir.path());
        for name in env_names(&b.text) {
            if std::env::var_os(&name).is_none() {
                cmd.env(&name, "docs-placeholder-value");
            }
        }
        for (k, v) in b.opts.iter().filter_map(|(k, v)| Some((k.strip_prefix("env:")?, v))) {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !stdout.contains("configuration OK") {
            errors.push(format!(
                "{}: idem serve --check-config: {}{stdout}",
                b.at(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        checked += 1;
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert!(checked >= 3, "{checked} configuration files checked");
}

#[test]
fn rust_snippets_are_compiled_by_a_test() {
    let mut errors = Vec::new();
    for b in all_blocks().into_iter().filter(|b| b.kind.as_deref() == Some("in-test")) {
        let path = book::root().join(&b.opts["file"]);
        let Ok(source) = std::fs::read_to_string(&path) else {
            errors.push(format!("{}: no file {}", b.at(), b.opts["file"]));
            continue;
        };
        // Each line of the snippet, in order, in the file (a doc test's `///` or `//!`
        // prefix and indentation aside).
        let lines: Vec<String> = source
            .lines()
            .map(|l| l.trim().trim_start_matches("//!").trim_start_matches("///").trim().to_owned())
            .collect();
        let mut at = 0;
        for want in b.text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            match lines[at..].iter().position(|l| l == want) {
                Some(i) => at += i + 1,
                None => {
                    errors.push(format!("{}: {:?} is not in {} (after line {at})", b.at(), want, b.opts["file"]));
                    break;
                }
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// A free loopback port (bound, then released for the page's own server).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The loopback ports a text names (`127.0.0.1:N`, `localhost:N`).
fn ports(text: &str) -> BTreeSet<u16> {
    let mut out = BTreeSet::new();
    for host in ["127.0.0.1:", "localhost:"] {
        for (i, _) in text.match_indices(host) {
            let digits: String = text[i + host.len()..].chars().take_while(char::is_ascii_digit).collect();
            if let Ok(p) = digits.parse::<u16>() {
                out.insert(p);
            }
        }
    }
    out.retain(|p| *p != 5432 && *p != 4222);
    out
}

/// `text` with `/NAME` (at a word's end) and `createdb … NAME` renamed to `unique`.
fn rename_database(text: &str, name: &str, unique: &str) -> String {
    let mut out = String::new();
    for line in text.split_inclusive('\n') {
        let mut l = String::new();
        let mut rest = line;
        let pattern = format!("/{name}");
        while let Some(i) = rest.find(&pattern) {
            let next = rest[i + pattern.len()..].chars().next();
            l.push_str(&rest[..i]);
            if next.is_none_or(|c| !(c.is_alphanumeric() || c == '_')) {
                l.push('/');
                l.push_str(unique);
            } else {
                l.push_str(&pattern);
            }
            rest = &rest[i + pattern.len()..];
        }
        l.push_str(rest);
        if l.contains("createdb") {
            l = l
                .split_inclusive(' ')
                .map(|w| if w.trim() == name { w.replace(name, unique) } else { w.to_owned() })
                .collect();
            let end = l.trim_end();
            if end.ends_with(&format!(" {name}")) {
                l = format!("{}{unique}{}", &end[..end.len() - name.len()], &l[end.len()..]);
            }
        }
        out.push_str(&l);
    }
    out
}

/// Every `idem_<hex>…` key placeholder replaced by `key`.
fn replace_key_placeholders(text: &str, key: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("idem_") {
        let after = &rest[i + 5..];
        let hex = after.chars().take_while(char::is_ascii_hexdigit).count();
        if after[hex..].starts_with('…') {
            out.push_str(&rest[..i]);
            out.push_str(key);
            rest = &after[hex + '…'.len_utf8()..];
        } else {
            out.push_str(&rest[..i + 5]);
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Runs one page's `run` blocks as one bash script; `Err` says what failed.
fn run_page(page: &Path, blocks: &[Block]) -> Result<String, String> {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let opts: BTreeMap<String, String> = blocks.iter().flat_map(|b| b.opts.clone()).collect();
    let server = opts.get("server").map(|_| book::FirstStart::new(dir.path()));
    let all: String = blocks.iter().map(|b| b.text.as_str()).collect::<Vec<_>>().join("\n");
    let mut port_map = BTreeMap::new();
    for p in ports(&all) {
        let to = match (&server, p) {
            (Some(s), 8080) => s.port,
            _ => free_port(),
        };
        port_map.insert(p, to);
    }
    let database =
        opts.get("database").map(|name| (name.clone(), format!("idem_docs_{}", uuid::Uuid::now_v7().simple())));
    let _drop = database.as_ref().map(|(_, unique)| book::DropDatabase(unique.clone()));
    let bin = common::idem_bin();
    let bin_dir = bin.parent().unwrap().display().to_string();
    let substitute = |text: &str| -> String {
        let mut t = text
            .replace("${CARGO_TARGET_DIR:-$PWD/target}/release", &bin_dir)
            .replace("target/release/idem", &bin.display().to_string());
        for (from, to) in &port_map {
            for host in ["127.0.0.1:", "localhost:"] {
                t = t.replace(&format!("{host}{from}"), &format!("{host}{to}"));
            }
        }
        if let Some(s) = &server {
            t = replace_key_placeholders(&t, &s.key);
        }
        if let Some((name, unique)) = &database {
            t = rename_database(&t, name, unique);
        }
        t
    };
    // The servers a page starts with `&` end with its script.
    let mut script = String::from("set -euo pipefail\ntrap 'kill -KILL $(jobs -p) 2>/dev/null || true' EXIT\n");
    let mut promised = Vec::new();
    for b in blocks {
        let text = substitute(&b.text);
        match b.lang.as_str() {
            // With file=NAME the program is saved for the page's own commands to run.
            "python" | "js" => {
                let ext = if b.lang == "js" { "mjs" } else { "py" };
                let file = b.opts.get("file").cloned().unwrap_or_else(|| format!("snippet_{}.{ext}", b.line));
                std::fs::write(dir.path().join(&file), &text).unwrap();
                if !b.opts.contains_key("file") {
                    script.push_str(&format!("{} {file}\n", if b.lang == "js" { "node" } else { "/usr/bin/python3" }));
                }
            }
            "sql" => {
                let file = format!("snippet_{}.sql", b.line);
                std::fs::write(dir.path().join(&file), &text).unwrap();
                script.push_str(&format!("psql -X -q -v ON_ERROR_STOP=1 \"$DATABASE_URL\" -f {file}\n"));
            }
            _ => {
                let copies = b.opts.get("overlap").map_or(1, |n| n.parse::<usize>().unwrap_or(1));
                for _ in 0..copies {
                    promised.extend(text.lines().filter_map(|l| {
                        let l = l.trim_start().strip_prefix("# HTTP/1.1 ")?;
                        Some(l.split_whitespace().next()?.to_owned())
                    }));
                }
                if copies == 1 {
                    script.push_str(&text);
                    script.push('\n');
                } else {
                    // Overlapping runs of a job (cron, CI): the copies start together in the
                    // page's directory, each in a subshell of its own, and each one's exit
                    // status counts.
                    script.push_str("overlap_pids=()\n");
                    for _ in 0..copies {
                        script.push_str(&format!("(\n{text}\n) &\noverlap_pids+=($!)\n"));
                    }
                    script.push_str("for pid in \"${overlap_pids[@]}\"; do wait \"$pid\"; done\n");
                }
            }
        }
    }
    for b in all_blocks().iter().filter(|b| b.page == page && b.kind.as_deref() == Some("config")) {
        std::fs::write(dir.path().join(&b.opts["file"]), substitute(&b.text)).unwrap();
    }
    let admin = reqwest::Url::parse(&idem_store::testing::pg_admin_url()).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env("PATH", format!("{bin_dir}:{}", std::env::var("PATH").unwrap_or_default()))
        .env("PGPASSWORD", admin.password().unwrap_or_default())
        .env_remove("IDEM_API_KEY")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(s) = &server {
        cmd.env("IDEM_URL", format!("http://127.0.0.1:{}", s.port));
    } else {
        cmd.env_remove("IDEM_URL");
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // Still running: end its process group (bash's builtin `kill` with `--`: procps'
            // /bin/kill once read a negative pid as -1, every process).
            let _ = Command::new("bash").args(["-c", &format!("kill -KILL -- -{pid}")]).stderr(Stdio::null()).status();
            return Err(format!("{}: did not finish within 120 s\n{script}", book::rel(page)));
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "{}: the page's snippets failed ({})\n--- script\n{script}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            book::rel(page),
            out.status
        ));
    }
    // What a block says it prints (expect="text", several separated by `|`) is printed.
    for b in blocks {
        for want in b.opts.get("expect").into_iter().flat_map(|e| e.split('|')) {
            if !stdout.contains(want) {
                return Err(format!(
                    "{}: the block at line {} expects {want:?} in what the page printed\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
                    book::rel(page),
                    b.line
                ));
            }
        }
    }
    // The statuses the page promises in `# HTTP/1.1 NNN` comments are the ones printed.
    let printed: Vec<String> = stdout
        .match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| stdout.get(i + 9..i + 12).map(str::to_owned))
        .filter(|s| s.chars().all(|c| c.is_ascii_digit()))
        .collect();
    if printed != promised {
        return Err(format!(
            "{}: the page promises the statuses {promised:?} in its `# HTTP/1.1` comments, the commands printed {printed:?}\n--- stdout\n{stdout}",
            book::rel(page)
        ));
    }
    Ok(format!("{} ({} blocks, {:.1} s)", book::rel(page), blocks.len(), started.elapsed().as_secs_f64()))
}

/// Pages run four at a time (the machine has two cores); `IDEM_DOCS_PAGE=text` runs only
/// the pages whose path contains `text`.
#[test]
fn the_runnable_snippets_run() {
    let only = std::env::var("IDEM_DOCS_PAGE").ok();
    let mut by_page: BTreeMap<PathBuf, Vec<Block>> = BTreeMap::new();
    for b in all_blocks().into_iter().filter(|b| b.kind.as_deref() == Some("run")) {
        if only.as_ref().is_none_or(|o| book::rel(&b.page).contains(o.as_str())) {
            by_page.entry(b.page.clone()).or_default().push(b);
        }
    }
    let queue = std::sync::Mutex::new(by_page.iter().collect::<Vec<_>>());
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                loop {
                    let Some((page, blocks)) = queue.lock().unwrap().pop() else { break };
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_page(page, blocks)))
                        .unwrap_or_else(|_| Err(format!("{}: the page's runner panicked", book::rel(page))));
                    results.lock().unwrap().push(r);
                }
            });
        }
    });
    let mut failures = Vec::new();
    for r in results.into_inner().unwrap() {
        match r {
            Ok(done) => eprintln!("ran {done}"),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(only.is_some() || by_page.len() >= 5, "{} pages with runnable snippets", by_page.len());
}

/// Links between pages and to headings resolve; every page is in SUMMARY.md (mdBook
/// renders only those).
#[test]
fn links_and_anchors_resolve_and_every_page_is_in_the_summary() {
    let root = book::root();
    let src = root.join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let mut errors = Vec::new();
    let mut links = 0;
    for page in book::pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        if page.starts_with(&src) && page.file_name().is_some_and(|f| f != "SUMMARY.md") {
            let rel = page.strip_prefix(&src).unwrap().display().to_string();
            if !summary.contains(&format!("]({rel})")) {
                errors.push(format!("{rel} is not in docs/src/SUMMARY.md"));
            }
        }
        let mut in_fence = false;
        for (n, line) in text.lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("```") || t.starts_with("~~~") {
                in_fence = !in_fence;
            }
            if in_fence {
                continue;
            }
            // Code spans hold no links (a pattern such as `[!#-\[\]-~]` is not one).
            let line: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
            for (i, _) in line.match_indices("](") {
                let target: String = line[i + 2..].chars().take_while(|c| *c != ')' && *c != ' ').collect();
                if target.is_empty()
                    || target.starts_with("http://")
                    || target.starts_with("https://")
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                links += 1;
                let (file, anchor) = match target.split_once('#') {
                    Some((f, a)) => (f, Some(a)),
                    None => (target.as_str(), None),
                };
                let target_path = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
                let at = format!("{}:{}", book::rel(&page), n + 1);
                let Ok(target_path) = target_path.canonicalize() else {
                    errors.push(format!("{at}: {target}: no such file"));
                    continue;
                };
                if page.starts_with(&src) && !target_path.starts_with(&src) {
                    errors.push(format!("{at}: {target} leaves docs/src: the built book would not have it"));
                }
                if let Some(anchor) = anchor {
                    let Ok(t) = std::fs::read_to_string(&target_path) else { continue };
                    if !book::heading_ids(&t).iter().any(|id| id == anchor) {
                        errors.push(format!("{at}: {target}: no heading with the id {anchor:?}"));
                    }
                }
            }
        }
    }
    for line in summary.lines() {
        if let Some(i) = line.find("](") {
            let target: String = line[i + 2..].chars().take_while(|c| *c != ')').collect();
            if !target.is_empty() && !src.join(&target).exists() {
                errors.push(format!("SUMMARY.md names {target}, which does not exist"));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert!(links >= 50, "{links} links checked");
}

#[test]
fn the_generated_reference_pages_match_the_code() {
    let mut stale = Vec::new();
    for page in ["cli", "http-api", "problems"] {
        let out = Command::new(common::idem_bin()).args(["reference", page]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let path = book::root().join(format!("docs/src/reference/{page}.md"));
        if std::fs::read(&path).ok().as_deref() != Some(&out.stdout[..]) {
            stale.push(book::rel(&path));
        }
    }
    assert!(
        stale.is_empty(),
        "{} no longer match(es) the code (the CLI, the OpenAPI document or the problem table changed): regenerate with `cargo run -p idem -- reference --write docs/src/reference` and commit the result",
        stale.join(", ")
    );
}

#[test]
fn the_readme_stays_short() {
    let readme = std::fs::read_to_string(book::root().join("README.md")).unwrap();
    let n = readme.lines().count();
    assert!(n <= 250, "README.md has {n} lines: keep it a start page (at most 250) and move detail into the book");
}
