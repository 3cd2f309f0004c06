//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The admin endpoints (axum on hyper: keep-alive, methods, and an accept loop that backs off
/// on errors such as running out of file descriptors): `GET /metrics` (Prometheus text),
/// `/healthz` (the process is alive), `/readyz` (503 once a drain has begun).
pub(crate) async fn admin_server(
    listener: tokio::net::TcpListener,
    metrics: etl_coordination_metrics::PrometheusHandle,
    ready: Arc<AtomicBool>,
) {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics.render()) }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.load(Ordering::Relaxed);
                async move {
                    if ready {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "the admin server stopped");
    }
}
