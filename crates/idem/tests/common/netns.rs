//! A network namespace of the test's own, for cutting one `idem serve` node off its
//! database while its clients still reach it (issue 33's partition test).
//!
//! `ip netns add` and two veth pairs, everything on this machine: the *client link*
//! (the test reaches the node at [`Netns::node_ip`]) and the *database link* (the node
//! reaches PostgreSQL at [`Netns::db_ip`], an address the test's own PostgreSQL listens
//! on). [`Netns::cut`] takes the database link down on both ends — packets are dropped,
//! no reset is sent, as in a real partition — and [`Netns::heal`] brings it back. The
//! subnets are /30s in 10.253/16 and 10.254/16 picked from the process id, so two runs
//! at once do not collide. Dropping it deletes the namespace, which deletes both veth
//! pairs. Needs root (`ip netns`), as the rest of the suite has.

use std::process::Command;

pub struct Netns {
    pub name: String,
    /// The node's address on the client link (inside the namespace).
    pub node_ip: String,
    /// The database's address on the database link (outside).
    pub db_ip: String,
    /// The database link's subnet, for PostgreSQL's pg_hba.conf.
    pub db_net: String,
    db_host_if: String,
    db_ns_if: String,
}

impl Netns {
    /// Creates the namespace and both links; panics naming the failing command.
    pub fn new() -> Netns {
        let id = std::process::id();
        let (a, b) = ((id / 64) % 250 + 1, (id % 64) * 4);
        let name = format!("idem-part-{id}");
        let (ch, cn, dh, dn) = (format!("ic{id}h"), format!("ic{id}n"), format!("id{id}h"), format!("id{id}n"));
        let client = (format!("10.253.{a}.{}", b + 1), format!("10.253.{a}.{}", b + 2));
        let db = (format!("10.254.{a}.{}", b + 1), format!("10.254.{a}.{}", b + 2));
        let ns = Netns {
            name: name.clone(),
            node_ip: client.1.clone(),
            db_ip: db.0.clone(),
            db_net: format!("10.254.{a}.{b}/30"),
            db_host_if: dh.clone(),
            db_ns_if: dn.clone(),
        };
        ip(&["netns", "add", &name]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        for (host_if, ns_if, (host_ip, ns_ip)) in [(&ch, &cn, &client), (&dh, &dn, &db)] {
            ip(&["link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", &name]);
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", host_if]);
            ip(&["link", "set", host_if, "up"]);
            ip(&["-n", &name, "addr", "add", &format!("{ns_ip}/30"), "dev", ns_if]);
            ip(&["-n", &name, "link", "set", ns_if, "up"]);
        }
        ns
    }

    /// Cuts the database link: both ends down, packets dropped, no reset.
    pub fn cut(&self) {
        ip(&["link", "set", &self.db_host_if, "down"]);
        ip(&["-n", &self.name, "link", "set", &self.db_ns_if, "down"]);
    }

    /// Brings the database link back.
    pub fn heal(&self) {
        ip(&["link", "set", &self.db_host_if, "up"]);
        ip(&["-n", &self.name, "link", "set", &self.db_ns_if, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace deletes its veth ends and so both pairs.
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
        let _ = Command::new("ip").args(["link", "delete", &self.db_host_if]).output();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip (Debian iproute2)");
    assert!(
        out.status.success(),
        "ip {} failed (the partition test needs root and iproute2): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}
