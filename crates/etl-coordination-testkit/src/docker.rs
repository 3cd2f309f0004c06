//! Separate hosts on one Docker engine, for the suite that needs what processes on one loopback
//! cannot show (crates/etl-coord/tests/hosts.rs): a JetStream cluster whose nodes talk over a
//! private `routes` network and serve clients over a second, `clients`, network; worker
//! containers on the `clients` network. A node is cut off from the others by disconnecting it
//! from `routes` (its clients still reach it), a worker from every node by disconnecting it
//! from `clients`, and any container is frozen with `docker pause`.
//!
//! Driven through the `docker` CLI. The images come from the environment `cargo xtask itest`
//! sets on its container path: `HOSTS_NATS_IMAGE` (a NATS image) and `HOSTS_WORKER_IMAGE` (the
//! `etl-coord` image of deploy/Dockerfile).

use std::net::SocketAddr;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::nats::{Leaders, monitor_at, request_at};

/// Runs `docker ARGS`; panics, with what docker said, unless it succeeds.
pub fn docker(args: &[&str]) -> String {
    let out = docker_output(args);
    assert!(
        out.status.success(),
        "docker {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn docker_output(args: &[&str]) -> Output {
    Command::new("docker").args(args).output().expect("the docker CLI runs")
}

/// Whether a docker (or compose) failure says a host port was taken: what happens when another
/// program binds a port between its choice and the engine's bind.
pub fn port_taken(stderr: &str) -> bool {
    stderr.contains("address already in use") || stderr.contains("port is already allocated")
}

/// The image named by `var` (set by `cargo xtask itest` on its container path).
pub fn image(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("{var} is not set: this suite runs on the container path of `cargo xtask itest`, which builds the images")
    })
}

/// A name unique to this process and moment, for networks and containers.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}-{}-{}", std::process::id(), nanos % 1_000_000)
}

/// A Docker network; removed when dropped (after the containers on it).
pub struct Network {
    /// Its name, as `docker network` commands take it.
    pub name: String,
}

impl Network {
    /// `docker network create NAME`.
    pub fn create(name: &str) -> Network {
        docker(&["network", "create", name]);
        Network { name: name.to_owned() }
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        let _ = docker_output(&["network", "rm", &self.name]);
    }
}

/// A container; removed (forcibly) when dropped.
pub struct Container {
    /// Its name, as `docker` commands take it.
    pub name: String,
}

impl Container {
    /// `docker run -d --name NAME ARGS`. Published ports should leave the host port to the
    /// engine (`-p 127.0.0.1::PORT`, read back with [`Container::published`]); the engine picks
    /// it from the ephemeral range without knowing what other programs hold, so a start that
    /// fails on a host port taken meanwhile is run again (up to five times).
    pub fn run(name: &str, args: &[&str]) -> Container {
        let mut all = vec!["run", "-d", "--name", name];
        all.extend(args);
        // The guard first: `docker run` can create the container and then fail to start it.
        let c = Container { name: name.to_owned() };
        for attempt in 1.. {
            let out = docker_output(&all);
            if out.status.success() {
                break;
            }
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(port_taken(&err) && attempt < 5, "docker {} failed: {}", all.join(" "), err.trim());
            let _ = docker_output(&["rm", "-f", name]);
        }
        c
    }

    /// The host address a published container port is reachable at.
    pub fn published(&self, port: &str) -> SocketAddr {
        let out = docker(&["port", &self.name, port]);
        let first = out.lines().find(|l| l.starts_with("127.0.0.1:")).unwrap_or_else(|| panic!("{out}"));
        first.parse().unwrap_or_else(|e| panic!("{first}: {e}"))
    }

    /// Waits for the container to exit (at most `limit`); its exit code, or `None` if it runs on.
    pub fn wait(&self, limit: Duration) -> Option<i32> {
        let t = Instant::now();
        loop {
            let state = docker(&["inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", &self.name]);
            if let Some(code) = state.strip_prefix("exited ") {
                return code.trim().parse().ok();
            }
            if t.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Everything the container printed (stdout and stderr).
    pub fn logs(&self) -> String {
        let out = docker_output(&["logs", &self.name]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    /// Freezes every process of the container (`docker pause`): its connections stay open and
    /// silent.
    pub fn pause(&self) {
        docker(&["pause", &self.name]);
    }

    /// Thaws it (`docker unpause`).
    pub fn unpause(&self) {
        docker(&["unpause", &self.name]);
    }

    /// Disconnects the container from `network` (every connection over it breaks; nothing on
    /// it is reachable until [`connect`](Self::connect)).
    pub fn disconnect(&self, network: &Network) {
        docker(&["network", "disconnect", "--force", &network.name, &self.name]);
    }

    /// Connects the container to `network` under `alias`.
    pub fn connect(&self, network: &Network, alias: &str) {
        docker(&["network", "connect", "--alias", alias, &network.name, &self.name]);
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = docker_output(&["rm", "-f", "-v", &self.name]);
    }
}

/// One node of a [`DockerCluster`].
pub struct DockerNode {
    /// The node's container.
    pub container: Container,
    /// `n0`, `n1`, ...: its `server_name`, and its name on the `clients` network.
    pub name: String,
    client: SocketAddr,
    monitor: SocketAddr,
}

impl DockerNode {
    /// How a client on the host reaches it.
    pub fn host_url(&self) -> String {
        format!("nats://{}", self.client)
    }

    /// How a container on the `clients` network reaches it.
    pub fn url(&self) -> String {
        format!("nats://{}:4222", self.name)
    }
}

/// A JetStream cluster of containers; see the module documentation. Dropping it removes the
/// containers and both networks.
pub struct DockerCluster {
    /// The nodes, in order (`n0`, `n1`, ...).
    pub nodes: Vec<DockerNode>,
    /// The network clients (workers) reach the nodes on.
    pub clients: Network,
    /// The network the nodes' routes run on.
    pub routes: Network,
}

impl DockerCluster {
    /// Starts `n` nodes of `image` and waits until JetStream has a meta leader. Routes go by
    /// aliases that exist only on `routes` (`nK-route`), and every node advertises that alias,
    /// so no route can form over `clients`; nodes do not advertise themselves to clients.
    /// Pings every second (two missed close a link), so a cut link is noticed in seconds as a
    /// cut cable would be by a kernel's timeouts on a real network.
    pub fn start(image: &str, n: usize) -> DockerCluster {
        let run = unique("hosts");
        let (routes, clients) =
            (Network::create(&format!("{run}-routes")), Network::create(&format!("{run}-clients")));
        let route_urls: Vec<String> = (0..n).map(|k| format!("nats://n{k}-route:6222")).collect();
        let mut nodes = Vec::new();
        for k in 0..n {
            let name = format!("n{k}");
            let config = format!(
                "server_name: {name}\nport: 4222\nhttp: 8222\nping_interval: \"1s\"\nping_max: 2\n\
                 jetstream {{ store_dir: /data }}\n\
                 cluster {{\n  name: hosts\n  listen: 0.0.0.0:6222\n  advertise: \"{name}-route:6222\"\n  \
                 no_advertise: true\n  routes: [{}]\n}}\n",
                route_urls.join(", ")
            );
            let container = run_node(&format!("{run}-{name}"), &clients, &name, image, &config);
            // Routes second: ports stay published on `clients`, so the host reaches a node that
            // is cut off from `routes`.
            container.connect(&routes, &format!("{name}-route"));
            let (client, monitor) = (container.published("4222/tcp"), container.published("8222/tcp"));
            nodes.push(DockerNode { container, name, client, monitor });
        }
        let c = DockerCluster { nodes, clients, routes };
        let t = Instant::now();
        while c.meta_leader_seen_by(0).is_none() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no JetStream meta leader: {}",
                c.nodes[0].container.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    /// Every node's URL for containers on `clients`, comma-separated (what `--store` takes).
    pub fn urls(&self, which: &[usize]) -> String {
        which.iter().map(|k| self.nodes[*k].url()).collect::<Vec<_>>().join(",")
    }

    /// Every node's URL from the host, comma-separated.
    pub fn host_urls(&self) -> String {
        self.nodes.iter().map(DockerNode::host_url).collect::<Vec<_>>().join(",")
    }

    /// Cuts node `k` off from the other nodes; its clients still reach it.
    pub fn cut_node(&self, k: usize) {
        self.nodes[k].container.disconnect(&self.routes);
    }

    /// Joins node `k` to the others again.
    pub fn heal_node(&self, k: usize) {
        let node = &self.nodes[k];
        node.container.connect(&self.routes, &format!("{}-route", node.name));
    }
}

/// Starts one node named `container` on `clients` (as `alias`) with `config`, passed in the
/// environment and written to a file by the image's shell (the public and the local NATS
/// images both have `sh`).
fn run_node(container: &str, clients: &Network, alias: &str, image: &str, config: &str) -> Container {
    let env = format!("CONF={config}");
    Container::run(
        container,
        &[
            "--network",
            &clients.name,
            "--network-alias",
            alias,
            "-p",
            "127.0.0.1::4222",
            "-p",
            "127.0.0.1::8222",
            "-e",
            &env,
            "--entrypoint",
            "/bin/sh",
            image,
            "-c",
            "printf '%s' \"$CONF\" > /tmp/hosts.conf && exec nats-server -c /tmp/hosts.conf",
        ],
    )
}

impl Leaders for DockerCluster {
    fn node_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    fn monitor_node(&self, k: usize, path: &str) -> Option<serde_json::Value> {
        monitor_at(self.nodes[k].monitor, path)
    }

    fn request_node(&self, k: usize, subject: &str, payload: &str) -> Option<String> {
        request_at(self.nodes[k].client, subject, payload)
    }
}

#[cfg(test)]
mod tests {
    use super::port_taken;

    #[test]
    fn the_engines_taken_port_errors_are_recognised_and_nothing_else() {
        // What `docker run -p` printed in CI, and what the engine says when its own allocator
        // collides.
        assert!(port_taken(
            "docker: Error response from daemon: failed to set up container networking: driver failed programming external connectivity on endpoint x: failed to bind host port for 127.0.0.1:32777:172.18.0.2:4222/tcp: address already in use"
        ));
        assert!(port_taken("Bind for 127.0.0.1:4222 failed: port is already allocated"));
        assert!(!port_taken("Unable to find image 'nats:2.11-alpine' locally"));
        assert!(!port_taken("Conflict. The container name \"/n0\" is already in use"));
    }
}
