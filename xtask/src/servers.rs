//! Everything the integration suites need, provisioned once per run: NATS servers (see
//! [`crate::nats`] for the order of sources), `promtool` and an S3 endpoint. Everything started
//! here stops when [`Servers`] drops.

use anyhow::Result;

use crate::nats::{
    Guard, NATS_IMAGE, NATS_OLD_IMAGE, NATS_OLD_VERSION, NATS_VERSION, Provisioned, cluster, single,
};
use crate::nats_bin::nats_server_bin;

/// Every NATS server (and tool) the integration tests need; servers stop when dropped.
pub struct Servers {
    _guards: Vec<Guard>,
    /// The current server, the 2.10 server, the cluster.
    nats: [Provisioned; 3],
    bin: String,
    promtool: String,
    s3: crate::moto::S3,
}

impl Servers {
    /// Provisions a current server, a 2.10 server (for the "server too old" test) and a 3-node
    /// cluster, in the order the module documentation gives.
    pub fn provision() -> Result<Servers> {
        let mut guards = Vec::new();
        let url =
            single("current server", ("NATS_URL", "NATS_IMAGE", NATS_IMAGE), NATS_VERSION, &mut guards)?;
        let old = single(
            "2.10 server",
            ("NATS_OLD_URL", "NATS_OLD_IMAGE", NATS_OLD_IMAGE),
            NATS_OLD_VERSION,
            &mut guards,
        )?;
        let cluster = cluster(&mut guards)?;
        for p in [&url, &old, &cluster] {
            println!("NATS {}: {} at {}", p.what, p.how, p.url);
        }
        let bin = nats_server_bin(NATS_VERSION)?.to_string_lossy().into_owned();
        let promtool = crate::promtool::promtool()?.to_string_lossy().into_owned();
        let s3 = crate::moto::start()?;
        Ok(Servers { _guards: guards, nats: [url, old, cluster], bin, promtool, s3 })
    }

    /// The servers this run provisioned (current, 2.10, cluster).
    pub fn nats(&self) -> &[Provisioned; 3] {
        &self.nats
    }

    /// The current single server's URL.
    pub fn nats_url(&self) -> &str {
        &self.nats[0].url
    }

    /// The environment the test suites read.
    pub fn env(&self) -> [(&str, &str); 6] {
        [
            ("NATS_URL", &self.nats[0].url),
            ("NATS_OLD_URL", &self.nats[1].url),
            ("NATS_CLUSTER_URL", &self.nats[2].url),
            ("NATS_SERVER_BIN", &self.bin),
            ("PROMTOOL", &self.promtool),
            ("S3_ENDPOINT", &self.s3.endpoint),
        ]
    }
}
