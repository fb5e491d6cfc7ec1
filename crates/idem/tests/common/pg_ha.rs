//! A PostgreSQL cluster with an HA manager, for the failover tests (issue 33):
//! pg_auto_failover (Debian's `postgresql-15-auto-failover` and `pg-auto-failover-cli`,
//! which `scripts/test.sh` installs) — a monitor and two data nodes, a primary and its
//! synchronous standby, each a `pg_autoctl run` process with its own PostgreSQL, all on
//! free loopback ports in a temp directory of the test's own (so no other test's server
//! is touched).
//!
//! The monitor's failure detection is tightened from its defaults (a node is considered
//! down after 20 s, a demoted primary is waited for 30 s) to about a second each, so a
//! failover takes seconds; every other setting is pg_auto_failover's. [`HaCluster::kill`]
//! ends a node as a machine loss would: SIGKILL, by PID, to its `pg_autoctl` processes
//! and its postmaster. [`HaCluster::rejoin`] starts it again; pg_auto_failover rewinds it
//! and makes it the new primary's standby. Run as root, every process runs as the
//! `postgres` user (PostgreSQL refuses root). Dropping the cluster SIGKILLs what it
//! started and removes its files.

use sqlx::Connection;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The monitor's settings, tightened so that a failover takes seconds (see the module).
const MONITOR_SETTINGS: [(&str, &str); 7] = [
    ("health_check_period", "1000"),
    ("health_check_timeout", "1000"),
    ("health_check_max_retries", "1"),
    ("health_check_retry_delay", "500"),
    ("node_considered_unhealthy_timeout", "2000"),
    ("primary_demote_timeout", "2000"),
    ("startup_grace_period", "2000"),
];

pub struct HaCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    ids: Option<(u32, u32)>,
    pub monitor_port: u16,
    pub ports: [u16; 2],
    monitor: Option<Child>,
    nodes: [Option<Child>; 2],
}

impl HaCluster {
    /// Creates the monitor and the two nodes and waits until node 0 is the primary and
    /// node 1 its synchronous standby; panics with the reason if it cannot.
    pub async fn start() -> HaCluster {
        let bin = super::pg_cluster::pg_bin_dir();
        assert!(
            Path::new("/usr/bin/pg_autoctl").exists(),
            "pg_autoctl (Debian pg-auto-failover-cli and postgresql-15-auto-failover; ./scripts/test.sh installs them)"
        );
        let dir = tempfile::Builder::new().prefix("idem-ha-").tempdir().unwrap();
        let ids = postgres_ids();
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        }
        let mut c = HaCluster {
            dir,
            bin,
            ids,
            monitor_port: free_port(),
            ports: [free_port(), free_port()],
            monitor: None,
            nodes: [None, None],
        };
        let pg_ctl = c.bin.join("pg_ctl").display().to_string();
        let monitor = c.path("monitor");
        let port = c.monitor_port.to_string();
        c.autoctl(&[
            "create",
            "monitor",
            "--pgdata",
            &monitor,
            "--pgport",
            &port,
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
            "--pgctl",
            &pg_ctl,
        ]);
        c.autoctl(&["config", "set", "--pgdata", &monitor, "postgresql.listen_addresses", "127.0.0.1"]);
        c.monitor = Some(c.run("monitor"));
        let admin = format!("postgres://postgres@127.0.0.1:{}/pg_auto_failover?sslmode=disable", c.monitor_port);
        let mut conn = connect_within(&admin, Duration::from_secs(30)).await;
        for (name, value) in MONITOR_SETTINGS {
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER SYSTEM SET pgautofailover.{name} = {value}")))
                .execute(&mut conn)
                .await
                .unwrap();
        }
        sqlx::query("SELECT pg_reload_conf()").execute(&mut conn).await.unwrap();
        for n in 0..2 {
            let (data, port) = (c.path(&format!("node{n}")), c.ports[n].to_string());
            let monitor_url =
                format!("postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable", c.monitor_port);
            let name = format!("node{n}");
            c.autoctl(&[
                "create",
                "postgres",
                "--pgdata",
                &data,
                "--pgport",
                &port,
                "--listen",
                "127.0.0.1",
                "--hostname",
                "127.0.0.1",
                "--name",
                &name,
                "--auth",
                "trust",
                "--no-ssl",
                "--pgctl",
                &pg_ctl,
                "--monitor",
                &monitor_url,
                "--dbname",
                "idem",
            ]);
            c.nodes[n] = Some(c.run(&format!("node{n}")));
            let want = if n == 0 { ["single", ""] } else { ["primary", "secondary"] };
            c.wait_for_states(&want[..=n], Duration::from_secs(60)).await;
        }
        c
    }

    /// The libpq multi-host URL of the `idem` database, as pg_auto_failover prints it
    /// (`pg_autoctl show uri`).
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/idem?sslmode=disable&target_session_attrs=read-write",
            self.ports[0], self.ports[1]
        )
    }

    /// The URL of node `n` alone.
    pub fn node_url(&self, n: usize) -> String {
        format!("postgres://postgres@127.0.0.1:{}/idem?sslmode=disable", self.ports[n])
    }

    /// The node the monitor reports as primary.
    pub async fn primary(&self) -> usize {
        let states = self.states().await;
        states.iter().position(|s| s.0 == "primary").unwrap_or_else(|| panic!("no primary: {states:?}"))
    }

    /// (reported state, assigned state) of each node, as the monitor has them.
    pub async fn states(&self) -> Vec<(String, String)> {
        let url = format!("postgres://postgres@127.0.0.1:{}/pg_auto_failover?sslmode=disable", self.monitor_port);
        let mut conn = connect_within(&url, Duration::from_secs(10)).await;
        let rows: Vec<(i32, String, String)> = sqlx::query_as(
            "SELECT nodeport, reportedstate::text, goalstate::text FROM pgautofailover.node ORDER BY nodeid",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        self.ports
            .iter()
            .map(|p| rows.iter().find(|r| r.0 == i32::from(*p)).map(|r| (r.1.clone(), r.2.clone())).unwrap_or_default())
            .collect()
    }

    /// Waits until the nodes report `want` (node by node; "" for a node not created
    /// yet), each also assigned that state, within `limit`; panics otherwise.
    pub async fn wait_for_states(&self, want: &[&str], limit: Duration) {
        let start = Instant::now();
        loop {
            let states = self.states().await;
            if want.iter().zip(&states).all(|(w, s)| w.is_empty() || (s.0 == *w && s.1 == *w)) {
                return;
            }
            assert!(start.elapsed() < limit, "the cluster did not reach {want:?} within {limit:?}: {states:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Ends node `n` as a machine loss would: SIGKILL to its `pg_autoctl` processes (so
    /// nothing restarts its PostgreSQL) and to its postmaster, each by PID.
    pub fn kill(&mut self, n: usize) {
        let mut keeper = self.nodes[n].take().expect("node running");
        let postmaster = postmaster_pid(&self.path(&format!("node{n}")));
        let tree = descendants_of(keeper.id());
        sigkill(keeper.id());
        for c in tree {
            sigkill(c);
        }
        if let Some(pm) = postmaster {
            sigkill(pm);
        }
        let _ = keeper.wait();
    }

    /// Starts node `n` again after [`HaCluster::kill`]: pg_auto_failover makes it the
    /// standby of the current primary.
    pub fn rejoin(&mut self, n: usize) {
        // The killed postmaster's children notice its death and exit; wait for them, or
        // the new postmaster finds their shared memory still in use.
        let start = Instant::now();
        while children_exist_of_data(&self.path(&format!("node{n}"))) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
        }
        self.nodes[n] = Some(self.run(&format!("node{n}")));
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("/usr/bin/pg_autoctl");
        let d = self.dir.path();
        cmd.args(args)
            .env("HOME", d)
            .env("XDG_CONFIG_HOME", d.join("config"))
            .env("XDG_DATA_HOME", d.join("share"))
            .env("XDG_RUNTIME_DIR", d.join("run"))
            .env("PATH", format!("{}:/usr/bin:/bin", self.bin.display()))
            .env_remove("PGHOST")
            .env_remove("PGPORT")
            .current_dir(d)
            .stdin(Stdio::null());
        if let Some((uid, gid)) = self.ids {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    fn autoctl(&self, args: &[&str]) {
        let _ = std::fs::create_dir_all(self.dir.path().join("run"));
        if let Some((uid, gid)) = self.ids {
            let _ = std::os::unix::fs::chown(self.dir.path().join("run"), Some(uid), Some(gid));
        }
        let out = self.command(args).output().expect("run pg_autoctl");
        assert!(
            out.status.success(),
            "pg_autoctl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `pg_autoctl run` for `name`'s data directory, its output in `name.log`.
    fn run(&self, name: &str) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .unwrap();
        let data = self.path(name);
        self.command(&["run", "--pgdata", &data])
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn pg_autoctl run")
    }

    /// The last lines of a node's log, for a failure message.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        let mut children: Vec<Child> = self.nodes.iter_mut().filter_map(Option::take).collect();
        children.extend(self.monitor.take());
        for c in &mut children {
            let tree = descendants_of(c.id());
            sigkill(c.id());
            for d in tree {
                sigkill(d);
            }
            let _ = c.wait();
        }
        for name in ["node0", "node1", "monitor"] {
            if let Some(pm) = postmaster_pid(&self.path(name)) {
                sigkill(pm);
            }
        }
    }
}

async fn connect_within(url: &str, limit: Duration) -> sqlx::PgConnection {
    let start = Instant::now();
    loop {
        match sqlx::PgConnection::connect(url).await {
            Ok(c) => return c,
            Err(e) if start.elapsed() > limit => panic!("cannot connect to {url}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The `postgres` user's uid and gid when this runs as root (PostgreSQL refuses root).
fn postgres_ids() -> Option<(u32, u32)> {
    let me = Command::new("id").arg("-u").output().ok()?;
    if !me.stdout.starts_with(b"0\n") {
        return None;
    }
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8(out.stdout).ok()?.trim().parse().ok()
    };
    Some((id("-u")?, id("-g")?))
}

/// The postmaster's PID from its data directory's `postmaster.pid`, if it is running.
fn postmaster_pid(data: &str) -> Option<u32> {
    let text = std::fs::read_to_string(Path::new(data).join("postmaster.pid")).ok()?;
    let pid: u32 = text.lines().next()?.trim().parse().ok()?;
    Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
}

/// Whether any process still runs from data directory `data` (a postmaster's children
/// after its SIGKILL carry `postgres` and its port; their command lines do not name the
/// directory, so this looks at the processes' working directory).
fn children_exist_of_data(data: &str) -> bool {
    std::fs::read_dir("/proc").into_iter().flatten().flatten().any(|e| {
        e.file_name().to_str().is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
            && std::fs::read_link(e.path().join("cwd")).is_ok_and(|p| p == Path::new(data))
    })
}

/// Every process below `pid` (children, their children, …), read before any is killed.
fn descendants_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let children = children_of(p);
        next.extend(&children);
        out.extend(children);
    }
    out
}

/// The PIDs whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                // pid (comm) state ppid …: the command may hold spaces and parentheses.
                s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

fn sigkill(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
}
