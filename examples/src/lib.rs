//! The workspace's compiled examples (`pipeline`, `pipeline_nats`, `custom_source`,
//! `core_loop`, `runner`: run them with `cargo run -p etl-coordination-examples --example NAME`), and the
//! code of `docs/CUSTOM_SOURCES.md`, compiled and run as this crate's documentation tests.
#![doc = include_str!("../../docs/CUSTOM_SOURCES.md")]

#[cfg(test)]
mod tests {
    /// The memory and NATS pipelines are the same program but for the statement that makes the
    /// stores (and their documentation). Compared statement by statement, so that rustfmt may
    /// wrap the longer one.
    #[test]
    fn the_nats_pipeline_differs_from_the_memory_one_by_one_statement() {
        let code = |f: &str| -> Vec<String> {
            let text = std::fs::read_to_string(format!("{}/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap();
            let code: Vec<&str> =
                text.lines().filter(|l| !l.trim_start().starts_with("//!")).map(str::trim).collect();
            code.join(" ").split(';').map(|s| s.split_whitespace().collect::<Vec<_>>().join(" ")).collect()
        };
        let (memory, nats) = (code("pipeline.rs"), code("pipeline_nats.rs"));
        assert!(memory.len() > 10, "{memory:#?}");
        assert_eq!(memory.len(), nats.len());
        let differ: Vec<_> = memory.iter().zip(&nats).filter(|(a, b)| a != b).collect();
        assert_eq!(differ.len(), 1, "{differ:#?}");
        assert!(differ[0].0.contains("JobStores::memory") && differ[0].1.contains("JobStores::nats"));
    }

    /// The README's snippet is `pipeline.rs`'s, line for line, so it compiles as long as the
    /// example does.
    #[test]
    fn the_readme_snippet_is_the_compiled_example() {
        let read = |f: &str| std::fs::read_to_string(format!("{}/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        let (readme, example) = (read("../README.md"), read("pipeline.rs"));
        let snippet = readme.split("```rust\n").nth(1).and_then(|s| s.split("```").next()).unwrap();
        let lines: Vec<&str> = snippet.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        assert!(lines.len() >= 4, "{snippet}");
        let example: Vec<&str> = example.lines().map(str::trim).collect();
        for line in lines {
            assert!(example.contains(&line), "README line not in examples/pipeline.rs: {line}");
        }
    }

    /// The runner's embedding (the program's flags and its `main`) is under 20 lines of code.
    #[test]
    fn the_runner_example_embeds_the_runner_in_under_20_lines() {
        let text = std::fs::read_to_string(format!("{}/runner.rs", env!("CARGO_MANIFEST_DIR"))).unwrap();
        let embedding =
            text.split("// The embedding: ").nth(1).and_then(|s| s.split("// The embedding ends").next());
        let code: Vec<&str> = embedding
            .expect("runner.rs marks its embedding")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .skip(1)
            .collect();
        assert!(code.iter().any(|l| l.contains("runner::main")), "{code:#?}");
        assert!(code.len() < 20, "{} lines: {code:#?}", code.len());
    }
}
