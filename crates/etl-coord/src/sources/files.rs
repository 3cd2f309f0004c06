//! Object-store backfill: lists the objects under a location (a local directory by default; an
//! `s3://`, `gs://` or `az://` URL with the `cloud` feature), bin-packs them by bytes into
//! splits of a target size, and reads each split's objects line by line.
//!
//! - Split ids are deterministic: a hash of the split's object paths and sizes, so re-planning
//!   the same input is a no-op (P4).
//! - The descriptor is the split's object list; the weight is its bytes (largest first).
//! - Progress is (object index, byte offset, line number): a takeover resumes mid-object.

use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use etl_coordination_driver::{Plan, PlanError, PlanKind, PlannedSplit, Planner, SplitId};
use futures_util::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path as ObjectPath;
use serde::{Deserialize, Serialize};

use crate::runner::{Record, SplitReader};

/// Default target bytes per split (the product document suggests tens of MB to ~128 MB).
pub const DEFAULT_SPLIT_BYTES: u64 = 64 * 1024 * 1024;

/// Where the files are and how to split them.
#[derive(Clone)]
pub struct FilesSource {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    location: String,
    split_bytes: u64,
}

impl std::fmt::Debug for FilesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesSource")
            .field("location", &self.location)
            .field("split_bytes", &self.split_bytes)
            .finish()
    }
}

/// A split's descriptor: its objects and their sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSplit {
    /// `(path, size)` in read order.
    pub objects: Vec<(String, u64)>,
}

/// Progress within a split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileProgress {
    /// Index of the object being read.
    pub object: usize,
    /// Byte offset of the next line in that object.
    pub offset: u64,
    /// Number of the next line in that object.
    pub line: u64,
}

impl FilesSource {
    /// Opens `location`: a local directory, or (with the `cloud` feature) an object-store URL.
    pub fn open(location: &str, split_bytes: u64) -> anyhow::Result<Self> {
        if split_bytes == 0 {
            bail!("--split-size must be at least 1 byte");
        }
        let (store, prefix): (Arc<dyn ObjectStore>, ObjectPath) = if location.contains("://") {
            let url = url::Url::parse(location).with_context(|| format!("invalid URL {location:?}"))?;
            // Credentials and settings come from the environment, as the cloud SDKs read them
            // (AWS_*, GOOGLE_*, AZURE_*): on Kubernetes, from a Secret or workload identity.
            let options = std::env::vars()
                .filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_"].iter().any(|p| k.starts_with(p)))
                .map(|(k, v)| (k.to_ascii_lowercase(), v));
            let (store, path) = object_store::parse_url_opts(&url, options).with_context(|| {
                format!(
                    "cannot open {location:?} (object-store URLs need etl-coord built with --features cloud)"
                )
            })?;
            (Arc::from(store), path)
        } else {
            let dir = std::path::Path::new(location);
            if !dir.is_dir() {
                bail!("input directory {location:?} does not exist or is not a directory");
            }
            let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .with_context(|| format!("cannot open directory {location:?}"))?;
            (Arc::new(fs), ObjectPath::default())
        };
        Ok(FilesSource { store, prefix, location: location.to_owned(), split_bytes })
    }

    /// Lists and bin-packs the input into splits.
    pub async fn plan_splits(&self) -> anyhow::Result<Vec<PlannedSplit>> {
        let mut objects: Vec<(String, u64)> = self
            .store
            .list(Some(&self.prefix))
            .map_ok(|m| (m.location.to_string(), m.size))
            .try_collect()
            .await
            .with_context(|| format!("listing {}", self.location))?;
        objects.sort();
        Ok(pack(objects, self.split_bytes))
    }

    /// A reader for one split, from its committed progress.
    pub fn reader(&self, descriptor: &Bytes, progress: Option<&Bytes>) -> anyhow::Result<FilesReader> {
        let split: FileSplit = serde_json::from_slice(descriptor).context("undecodable files descriptor")?;
        let progress = match progress {
            Some(p) => serde_json::from_slice(p).context("undecodable files progress")?,
            None => FileProgress::default(),
        };
        Ok(FilesReader { store: self.store.clone(), split, progress, buffer: None })
    }
}

/// Greedy bin-packing in path order: objects join the current split until it would exceed the
/// target; an object larger than the target gets a split of its own.
pub fn pack(objects: Vec<(String, u64)>, target: u64) -> Vec<PlannedSplit> {
    let mut splits = Vec::new();
    let mut current: Vec<(String, u64)> = Vec::new();
    let mut bytes = 0u64;
    let flush = |current: &mut Vec<(String, u64)>, bytes: &mut u64, splits: &mut Vec<PlannedSplit>| {
        if current.is_empty() {
            return;
        }
        let objects = std::mem::take(current);
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (p, s) in &objects {
            for b in p.as_bytes().iter().chain(&s.to_le_bytes()) {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        let id = SplitId::new(format!("f-{h:016x}")).expect("hex ids are valid");
        let descriptor = Bytes::from(serde_json::to_vec(&FileSplit { objects }).expect("serializable"));
        splits.push(PlannedSplit { id, descriptor, weight: (*bytes).max(1) });
        *bytes = 0;
    };
    for (path, size) in objects {
        if !current.is_empty() && bytes + size > target {
            flush(&mut current, &mut bytes, &mut splits);
        }
        bytes += size;
        current.push((path, size));
    }
    flush(&mut current, &mut bytes, &mut splits);
    splits
}

/// The planner of a files source.
#[derive(Clone, Debug)]
pub struct FilesPlanner(pub FilesSource);

impl Planner for FilesPlanner {
    fn fingerprint(&self) -> String {
        format!("files/v1 location={} split_bytes={}", self.0.location, self.0.split_bytes)
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let splits = self.0.plan_splits().await.map_err(|e| PlanError(format!("{e:#}")))?;
        Ok(Plan { kind: PlanKind::Final, splits })
    }
}

/// Reads a files split line by line.
pub struct FilesReader {
    store: Arc<dyn ObjectStore>,
    split: FileSplit,
    progress: FileProgress,
    /// The current object's bytes from the progress offset on.
    buffer: Option<(Bytes, usize)>,
}

impl SplitReader for FilesReader {
    async fn next(&mut self) -> anyhow::Result<Option<Record>> {
        loop {
            let Some((path, size)) = self.split.objects.get(self.progress.object).cloned() else {
                return Ok(None);
            };
            if self.buffer.is_none() {
                if self.progress.offset >= size {
                    self.progress = FileProgress { object: self.progress.object + 1, offset: 0, line: 0 };
                    continue;
                }
                let bytes = self
                    .store
                    .get_range(&ObjectPath::from(path.as_str()), self.progress.offset..size)
                    .await
                    .with_context(|| format!("reading {path}"))?;
                self.buffer = Some((bytes, 0));
            }
            let (bytes, pos) = self.buffer.as_mut().expect("buffer");
            if *pos >= bytes.len() {
                self.buffer = None;
                self.progress = FileProgress { object: self.progress.object + 1, offset: 0, line: 0 };
                continue;
            }
            let rest = &bytes[*pos..];
            let len = rest.iter().position(|b| *b == b'\n').map_or(rest.len(), |i| i + 1);
            let content = String::from_utf8_lossy(&rest[..len]).trim_end_matches(['\n', '\r']).to_owned();
            *pos += len;
            let key = format!("{path}:{}", self.progress.line + 1);
            self.progress.offset += len as u64;
            self.progress.line += 1;
            let progress = Bytes::from(serde_json::to_vec(&self.progress).expect("serializable"));
            return Ok(Some(Record { key, content, progress }));
        }
    }

    fn final_progress(&self) -> Bytes {
        let end = FileProgress { object: self.split.objects.len(), offset: 0, line: 0 };
        Bytes::from(serde_json::to_vec(&end).expect("serializable"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_is_deterministic_and_respects_the_target() {
        let objects: Vec<(String, u64)> = (0..10).map(|i| (format!("d/{i}.txt"), 40)).collect();
        let a = pack(objects.clone(), 100);
        let b = pack(objects, 100);
        assert_eq!(a, b, "same input, same splits and ids");
        assert_eq!(a.len(), 5, "two 40-byte objects per 100-byte split");
        assert!(a.iter().all(|s| s.weight == 80));
        let big = pack(vec![("big".into(), 500), ("small".into(), 10)], 100);
        assert_eq!(big.len(), 2, "an oversized object gets its own split");
    }

    #[tokio::test]
    async fn a_reader_resumes_mid_object_from_its_progress() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "one\ntwo\nthree\n").unwrap();
        std::fs::write(dir.path().join("b.txt"), "four\nfive").unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let splits = src.plan_splits().await.unwrap();
        assert_eq!(splits.len(), 1);
        let mut r = src.reader(&splits[0].descriptor, None).unwrap();
        let first = r.next().await.unwrap().unwrap();
        let second = r.next().await.unwrap().unwrap();
        assert_eq!((first.key.as_str(), first.content.as_str()), ("a.txt:1", "one"));
        assert_eq!(second.key, "a.txt:2");
        // A new owner resumes after "two".
        let mut r2 = src.reader(&splits[0].descriptor, Some(&second.progress)).unwrap();
        let mut rest = Vec::new();
        while let Some(rec) = r2.next().await.unwrap() {
            rest.push(rec.key);
        }
        assert_eq!(rest, ["a.txt:3", "b.txt:1", "b.txt:2"]);
    }

    #[test]
    fn a_missing_directory_is_a_clear_error() {
        let err = FilesSource::open("/definitely/not/here", 10).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
    }
}
