//! Test support shared by the integration suites: NATS servers and clusters a test owns
//! ([`NatsServer`], [`NatsCluster`]) and a TCP [`Proxy`] that cuts or stalls a link, for
//! partitions between real processes without containers or network namespaces.

mod nats;
mod proxy;

pub use nats::{NatsCluster, NatsServer};
pub use proxy::Proxy;
