//! A PostgreSQL server of the test's own, for tests that stop and start the server.
//!
//! Stopping the shared server (`IDEM_TEST_PG_URL`) would break every other test that uses
//! it at the same moment — other test binaries of the same run and other runs on the
//! machine. So an outage test runs the same PostgreSQL binaries (Debian's
//! `/usr/lib/postgresql/VERSION/bin`, which `scripts/test.sh` installs) as a throw-away
//! cluster of its own: `initdb` into a temp dir, `pg_ctl start|stop` on a free loopback
//! port, trust authentication. Run as root, the server runs as the `postgres` user (it
//! refuses root). Dropping the guard stops the server (even when the test panicked) and
//! removes its files.

use std::path::PathBuf;
use std::process::Command;

pub struct PgCluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    pub port: u16,
    /// Addresses to listen on besides 127.0.0.1.
    also_listen: Option<String>,
}

impl PgCluster {
    /// `initdb` and start a new cluster; panics with the reason if it cannot.
    pub fn start() -> PgCluster {
        PgCluster::start_listening(None)
    }

    /// As [`PgCluster::start`], also listening on `also` = (address, subnet), whose
    /// clients are trusted as loopback's are (a test's network namespace).
    pub fn start_listening(also: Option<(&str, &str)>) -> PgCluster {
        let bin = pg_bin_dir();
        let dir = tempfile::Builder::new().prefix("idem-pg-").tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let cluster = PgCluster { bin, dir, port, also_listen: also.map(|a| a.0.to_owned()) };
        if is_root() {
            let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(cluster.dir.path()).status();
            assert!(status.unwrap().success(), "chown the cluster's directory to postgres");
        }
        let data = cluster.data();
        cluster.run("initdb", &["-D", &data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]);
        if let Some((_, net)) = also {
            let hba = cluster.dir.path().join("data/pg_hba.conf");
            let mut text = std::fs::read_to_string(&hba).unwrap();
            text.push_str(&format!("host all all {net} trust\n"));
            std::fs::write(&hba, text).unwrap();
        }
        cluster.pg_ctl_start();
        cluster
    }

    /// The admin URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable", self.port)
    }

    /// `pg_ctl stop -m fast`: connections are closed, the port refuses.
    pub fn stop(&self) {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]);
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    pub fn pg_ctl_start(&self) {
        let listen = match &self.also_listen {
            Some(a) => format!("127.0.0.1,{a}"),
            None => "127.0.0.1".to_owned(),
        };
        let opts = format!(
            "-c listen_addresses={listen} -p {} -k {} -c fsync=off -c max_connections=100",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("server.log").display().to_string();
        self.run("pg_ctl", &["-D", &self.data(), "-o", &opts, "-l", &log, "-w", "-t", "30", "start"]);
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let exe = self.bin.join(tool);
        let out = if is_root() {
            Command::new("runuser").args(["-u", "postgres", "--"]).arg(&exe).args(args).output()
        } else {
            Command::new(&exe).args(args).output()
        }
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The newest of Debian's PostgreSQL binary directories (`/usr/lib/postgresql/N/bin`).
pub fn pg_bin_dir() -> PathBuf {
    std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's binaries in /usr/lib/postgresql (run ./scripts/test.sh, which installs them)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .max()
        .expect("an initdb under /usr/lib/postgresql/*/bin")
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        // Immediate: nothing of this cluster is kept. Errors are ignored (already stopped).
        let exe = self.bin.join("pg_ctl");
        let data = self.data();
        let args = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
        let _ = if is_root() {
            Command::new("runuser").args(["-u", "postgres", "--"]).arg(&exe).args(args).output()
        } else {
            Command::new(&exe).args(args).output()
        };
    }
}

fn is_root() -> bool {
    // SAFETY-free check: the effective uid as `id -u` prints it.
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}
