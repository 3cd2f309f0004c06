//! NATS servers a test owns (from `NATS_SERVER_BIN`, which `cargo xtask ci` provisions): one
//! server, or a cluster whose route links run through [`Proxy`]s, one per ordered pair of
//! nodes, so a test can cut or stall one node off from the others while clients still reach
//! it.

use crate::free_port;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::proxy::Proxy;

fn bin() -> String {
    std::env::var("NATS_SERVER_BIN")
        .expect("NATS_SERVER_BIN is not set: run `cargo xtask ci` (or `cargo xtask itest`), which provisions nats-server")
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// One `nats-server` process with JetStream, its configuration and data in a directory of its
/// own. Killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    name: String,
    port: u16,
    monitor: u16,
    config: PathBuf,
    dir: tempfile::TempDir,
}

impl NatsServer {
    /// A single server on free loopback ports.
    pub fn start() -> NatsServer {
        Self::spawn("single", "")
    }

    /// A single server with `extra` added to its configuration (an `authorization` block,
    /// a `tls` block).
    pub fn start_with(extra: &str) -> NatsServer {
        Self::spawn("single", extra)
    }

    /// A single server without JetStream (a misconfigured deployment).
    pub fn start_without_jetstream() -> NatsServer {
        Self::spawn("nojs", "jetstream: disabled")
    }

    /// A server named `name` with `extra` configuration (a cluster block, or JetStream off).
    /// Free ports are picked by binding port 0 and letting go, so another process may take
    /// one before the server binds it: then the server starts again on fresh ports.
    fn spawn(name: &str, extra: &str) -> NatsServer {
        let mut dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("nats.conf");
        let store = dir.path().join("js");
        let jetstream = if extra.contains("jetstream: disabled") {
            String::new()
        } else {
            format!("jetstream {{ store_dir: {:?} }}", store.display().to_string())
        };
        let mut tries = 0;
        loop {
            let (port, monitor) = (free_port(), free_port());
            let text = format!(
                "server_name: {name}\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n{jetstream}\n{extra}\n"
            );
            std::fs::write(&config, text).expect("write nats.conf");
            let mut s =
                NatsServer { child: None, name: name.to_owned(), port, monitor, config: config.clone(), dir };
            match s.launch() {
                Ok(()) => return s,
                Err(log) if log.contains("address already in use") && tries < 5 => {
                    tries += 1;
                    dir = std::mem::replace(&mut s.dir, tempfile::tempdir().expect("temp dir"));
                }
                Err(log) => panic!("{name} did not start: {log}"),
            }
        }
    }

    /// Starts the server again (same ports, same data) after [`kill`](Self::kill).
    pub fn restart(&mut self) {
        if let Err(log) = self.launch() {
            panic!("{} did not start again: {log}", self.name);
        }
    }

    /// Starts the process and waits until it says it is ready; its log if it exits first or
    /// is not ready within 15 s.
    fn launch(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "{} is running", self.name);
        let log = std::fs::File::create(self.dir.path().join("server.log")).expect("log file");
        let child = Command::new(bin())
            .arg("-c")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let t = Instant::now();
        while !self.log().contains("Server is ready") {
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()).is_some();
            if exited || t.elapsed() > Duration::from_secs(15) {
                self.kill();
                return Err(self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Kills the server (SIGKILL, like a crash); [`restart`](Self::restart) brings it back.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's name (`server_name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client address (to put a [`Proxy`] in front of).
    pub fn addr(&self) -> SocketAddr {
        loopback(self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// One NATS request to this server; see [`request_at`].
    pub fn request(&self, subject: &str, payload: &str) -> Option<String> {
        request_at(loopback(self.port), subject, payload)
    }

    /// `GET path` on the monitoring port, as JSON.
    pub fn monitor(&self, path: &str) -> Option<serde_json::Value> {
        monitor_at(loopback(self.monitor), path)
    }
}

/// One NATS request (core protocol, no client library) to the server at `addr`: publishes
/// `payload` on `subject` and returns the first reply.
pub fn request_at(addr: SocketAddr, subject: &str, payload: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let inbox = "_INBOX.testkit";
    write!(
        s,
        "CONNECT {{\"verbose\":false,\"pedantic\":false}}\r\nSUB {inbox} 1\r\nPUB {subject} {inbox} {}\r\n{payload}\r\n",
        payload.len()
    )
    .ok()?;
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
        if text.contains("PING\r\n") {
            text = text.replace("PING\r\n", "");
            s.write_all(b"PONG\r\n").ok()?;
        }
        if let Some(i) = text.find(&format!("MSG {inbox} 1 ")) {
            let rest = &text[i..];
            if let Some((header, body)) = rest.split_once("\r\n") {
                let len: usize = header.rsplit(' ').next()?.parse().ok()?;
                if body.len() >= len {
                    return Some(body[..len].to_owned());
                }
            }
        }
    }
}

/// `GET path` on the monitoring port at `addr`, as JSON.
pub fn monitor_at(addr: SocketAddr, path: &str) -> Option<serde_json::Value> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let (_, json) = body.split_once("\r\n\r\n")?;
    serde_json::from_str(json).ok()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster of nodes `n0`, `n1`, ... whose route links go through proxies, one per ordered
/// pair of nodes. Clients connect to the nodes directly (or through proxies of their own).
/// Servers do not advertise each other to clients, so a client stays with the nodes it was
/// given.
pub struct NatsCluster {
    /// The nodes, in order.
    pub nodes: Vec<NatsServer>,
    /// `links[i][j]`: the proxy node `i` dials to reach node `j` (`None` on the diagonal).
    links: Vec<Vec<Option<Proxy>>>,
}

impl NatsCluster {
    /// Starts `n` nodes and waits until JetStream has a meta leader.
    pub fn start(n: usize) -> NatsCluster {
        let cluster_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let links: Vec<Vec<Option<Proxy>>> = (0..n)
            .map(|i| (0..n).map(|j| (i != j).then(|| Proxy::start(loopback(cluster_ports[j])))).collect())
            .collect();
        let nodes = (0..n)
            .map(|i| {
                let routes: Vec<String> = (0..n)
                    .filter(|j| *j != i)
                    .map(|j| format!("nats-route://127.0.0.1:{}", links[i][j].as_ref().expect("proxy").port()))
                    .collect();
                // One route connection per pair (no pool); the advertised route address leads
                // nowhere, so no node dials another directly (gossiped implicit routes fail and
                // are not retried) and every route runs through its proxy; clients only know
                // the URLs they are given.
                let cluster = format!(
                    "cluster {{\n  name: own\n  listen: 127.0.0.1:{}\n  advertise: \"127.0.0.1:1\"\n  pool_size: -1\n  no_advertise: true\n  routes: [{}]\n}}",
                    cluster_ports[i],
                    routes.join(", ")
                );
                NatsServer::spawn(&format!("n{i}"), &cluster)
            })
            .collect();
        let c = NatsCluster { nodes, links };
        c.wait_for_meta_leader();
        c
    }

    fn wait_for_meta_leader(&self) {
        let t = Instant::now();
        loop {
            if Leaders::meta_leader_seen_by(self, 0).is_some() {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no JetStream meta leader: {}",
                self.nodes[0].log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Every node's URL, comma-separated (what `--store` takes).
    pub fn urls(&self) -> String {
        self.nodes.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    fn links_of(&self, k: usize) -> impl Iterator<Item = &Proxy> {
        self.links.iter().enumerate().flat_map(move |(i, row)| {
            row.iter().enumerate().filter_map(move |(j, p)| p.as_ref().filter(|_| i == k || j == k))
        })
    }

    /// Cuts node `k` off from the other nodes (its clients still reach it).
    pub fn cut_node(&self, k: usize) {
        self.links_of(k).for_each(Proxy::cut);
    }

    /// Stalls the route links of node `k`: it falls behind the others, then catches up on heal.
    pub fn stall_node(&self, k: usize) {
        self.links_of(k).for_each(Proxy::stall);
    }

    /// Heals the route links of node `k`.
    pub fn heal_node(&self, k: usize) {
        self.links_of(k).for_each(Proxy::heal);
    }
}

impl Leaders for NatsCluster {
    fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name().to_owned()).collect()
    }

    fn monitor_node(&self, k: usize, path: &str) -> Option<serde_json::Value> {
        self.nodes[k].monitor(path)
    }

    fn request_node(&self, k: usize, subject: &str, payload: &str) -> Option<String> {
        self.nodes[k].request(subject, payload)
    }
}

/// Finding and moving leaders on a JetStream cluster, whichever way its nodes run (processes
/// here, containers in [`crate::docker`]): what a node's monitoring port and a request to it
/// tell.
pub trait Leaders {
    /// The nodes' `server_name`s, in order.
    fn node_names(&self) -> Vec<String>;
    /// `GET path` on node `k`'s monitoring port, as JSON.
    fn monitor_node(&self, k: usize, path: &str) -> Option<serde_json::Value>;
    /// One request to node `k`; its first reply.
    fn request_node(&self, k: usize, subject: &str, payload: &str) -> Option<String>;

    /// The JetStream meta leader node `k` knows of, if any.
    fn meta_leader_seen_by(&self, k: usize) -> Option<String> {
        self.monitor_node(k, "/jsz")
            .and_then(|j| j["meta_cluster"]["leader"].as_str().map(str::to_owned))
            .filter(|l| !l.is_empty())
    }

    /// The index of the node leading `stream`, as some live node reports it.
    fn stream_leader(&self, stream: &str) -> Option<usize> {
        let names = self.node_names();
        for k in 0..names.len() {
            let Some(j) = self.monitor_node(k, "/jsz?streams=true") else { continue };
            let accounts = j["account_details"].as_array().cloned().unwrap_or_default();
            for acc in accounts {
                for s in acc["stream_detail"].as_array().cloned().unwrap_or_default() {
                    if s["name"] == stream
                        && let Some(leader) = s["cluster"]["leader"].as_str()
                    {
                        return names.iter().position(|n| n == leader);
                    }
                }
            }
        }
        None
    }

    /// Moves the leadership of `stream` to node `k` (leader stepdowns, preferring `k`), and
    /// waits until that node leads it.
    fn make_leader(&self, stream: &str, k: usize) {
        let t = Instant::now();
        let preferred = format!("{{\"placement\":{{\"preferred\":\"{}\"}}}}", self.node_names()[k]);
        loop {
            let leader = self.stream_leader(stream);
            if leader == Some(k) {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "{stream} is still led by {leader:?}, not n{k}");
            if let Some(l) = leader {
                let subject = format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}");
                let _ = self.request_node(l, &subject, &preferred);
                let waited = Instant::now();
                while self.stream_leader(stream) == Some(l) && waited.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
