//! Real mail servers on loopback for the SMTP connector's tests: aiosmtpd (Debian
//! `python3-aiosmtpd`) delivering into a Maildir, and Dovecot (Debian `dovecot-imapd`)
//! serving that Maildir over IMAP. Both run as `nobody` (Dovecot refuses root for mail),
//! each test with its own directory and ports; killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const IMAP_USER: &str = "idem";
pub const IMAP_PASSWORD: &str = "imap-test-secret";
const NOBODY: u32 = 65534;

pub struct MailServers {
    pub smtp_port: u16,
    pub imap_port: u16,
    pub maildir: PathBuf,
    _dir: tempfile::TempDir,
    children: Vec<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_for(port: u16, what: &str) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(15), "{what} did not start on port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl MailServers {
    pub fn start() -> MailServers {
        for (bin, pkg) in [("/usr/sbin/dovecot", "dovecot-imapd"), ("/usr/bin/setpriv", "util-linux")] {
            assert!(
                std::path::Path::new(bin).exists(),
                "{bin} is missing: run ./scripts/test.sh, which installs {pkg}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let maildir = root.join("Maildir");
        for d in ["Maildir/cur", "Maildir/new", "Maildir/tmp", "home", "run", "state"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        for d in ["Maildir", "Maildir/cur", "Maildir/new", "Maildir/tmp", "home"] {
            std::os::unix::fs::chown(root.join(d), Some(NOBODY), Some(NOBODY)).unwrap();
        }
        std::fs::write(root.join("passwd"), format!("{IMAP_USER}:{{PLAIN}}{IMAP_PASSWORD}::::::\n")).unwrap();
        let (smtp_port, imap_port) = (free_port(), free_port());
        let r = root.display();
        let conf = format!(
            "base_dir = {r}/run\nstate_dir = {r}/state\nlog_path = {r}/dovecot.log\nprotocols = imap\nlisten = 127.0.0.1\n\
             ssl = no\ndisable_plaintext_auth = no\nauth_mechanisms = plain login\nfirst_valid_uid = 1\n\
             mail_location = maildir:{r}/Maildir\n\
             passdb {{\n  driver = passwd-file\n  args = {r}/passwd\n}}\n\
             userdb {{\n  driver = static\n  args = uid={NOBODY} gid={NOBODY} home={r}/home\n}}\n\
             service imap-login {{\n  inet_listener imap {{\n    address = 127.0.0.1\n    port = {imap_port}\n  }}\n  inet_listener imaps {{\n    port = 0\n  }}\n}}\n\
             service pop3-login {{\n  inet_listener pop3 {{\n    port = 0\n  }}\n}}\n\
             service submission-login {{\n  inet_listener submission {{\n    port = 0\n  }}\n}}\n"
        );
        std::fs::write(root.join("dovecot.conf"), conf).unwrap();
        let dovecot = Command::new("/usr/sbin/dovecot")
            .args(["-F", "-c"])
            .arg(root.join("dovecot.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start dovecot");
        let smtpd = Command::new("/usr/bin/setpriv")
            .args([
                &format!("--reuid={NOBODY}"),
                &format!("--regid={NOBODY}"),
                "--clear-groups",
                "/usr/bin/python3",
                "-m",
                "aiosmtpd",
                "-n",
                "-l",
            ])
            .arg(format!("127.0.0.1:{smtp_port}"))
            .args(["-c", "aiosmtpd.handlers.Mailbox"])
            .arg(&maildir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start aiosmtpd (Debian python3-aiosmtpd)");
        let servers = MailServers { smtp_port, imap_port, maildir, _dir: dir, children: vec![dovecot, smtpd] };
        wait_for(smtp_port, "aiosmtpd");
        wait_for(imap_port, "dovecot");
        servers
    }

    /// Messages delivered so far (new and seen).
    pub fn delivered(&self) -> Vec<String> {
        ["new", "cur"]
            .iter()
            .flat_map(|d| std::fs::read_dir(self.maildir.join(d)).into_iter().flatten())
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
            .collect()
    }
}

impl Drop for MailServers {
    fn drop(&mut self) {
        for c in &mut self.children {
            // TERM lets Dovecot's master stop its children too.
            let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
            let _ = c.wait();
        }
    }
}
