//! Test support shared by the integration suites: NATS servers and clusters a test owns
//! ([`NatsServer`], [`NatsCluster`]), a TCP [`Proxy`] that cuts or stalls a link, for
//! partitions between real processes without containers or network namespaces, and separate
//! hosts on a Docker engine ([`docker`]) for what one loopback cannot show; a PostgreSQL
//! server ([`PgServer`]) for the database source.

pub mod docker;
mod nats;
pub mod postgres;
mod proxy;

pub use nats::{Leaders, NatsCluster, NatsServer, monitor_at, request_at};
pub use postgres::PgServer;
pub use proxy::Proxy;

/// A loopback port nobody listens on now (the kernel's choice), and never handed out before by
/// this process: a test asking for several at once (a cluster's client, route and monitoring
/// ports) gets distinct ones even when the kernel offers a port again as soon as the probe
/// closed it. Another process may still take it before the caller binds it: callers that hand
/// it to a server retry on "address in use".
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    loop {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}
