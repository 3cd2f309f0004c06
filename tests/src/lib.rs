//! Workspace-level integration suites of etl-coordination. The suites are the files next to
//! this package's manifest (`simulation.rs`, ...); this library is intentionally empty.
