//! The store conformance suite against the memory backend, on paused (virtual) tokio time.

async fn fresh_store() -> etl_coordination_memory::MemoryStore {
    etl_coordination_memory::MemoryStore::new()
}

etl_coordination_store::conformance_tests!(
    #[tokio::test(start_paused = true)]
    fresh_store
);
