//! Everything the integration suites need, provisioned once per run: NATS servers (see
//! [`crate::nats`] for the order of sources), `promtool` and an S3 endpoint. Everything started
//! here stops when [`Servers`] drops.

use anyhow::Result;

use crate::nats::{
    Guard, NATS_IMAGE, NATS_OLD_IMAGE, NATS_OLD_VERSION, NATS_VERSION, nats_server_bin, single, start_cluster,
};

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

    /// The current single server's URL.
    pub fn nats_url(&self) -> &str {
        &self.url
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
