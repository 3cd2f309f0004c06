//! Test support shared by the integration suites: NATS servers and clusters a test owns
//! ([`NatsServer`], [`NatsCluster`]), a TCP [`Proxy`] that cuts or stalls a link, for
//! partitions between real processes without containers or network namespaces, and separate
//! hosts on a Docker engine ([`docker`]) for what one loopback cannot show.

pub mod docker;
mod nats;
mod proxy;

pub use nats::{Leaders, NatsCluster, NatsServer, monitor_at, request_at};
pub use proxy::Proxy;
