//! The lines of the objects under a location: a local directory, or (feature `cloud`) an
//! `s3://`, `gs://` or `az://` URL.
//!
//! - **Backfill** ([`FilesSource::open`]): the objects listed at planning time, bin-packed in
//!   path order into splits of about `split_bytes` (an object larger than that is a split of
//!   its own); a [`PlanKind::Final`] plan. Split ids are a hash of the split's paths and sizes,
//!   so re-planning the same input is a no-op (P4).
//! - **Follow** ([`FilesSource::follow`]): every object is a split of its own, its id a hash of
//!   its path, in a [`PlanKind::Open`] plan the leader re-runs every `replan_interval`: objects
//!   that appear are picked up, none is read twice. Objects must appear whole (object stores
//!   do; in a local directory, write under another name and rename); one that changes after it
//!   was planned is read as it was (up to its planned size).
//!
//! Records are lines ([`Line`]: `path:line`, the text without its end; in a byte range of a
//! large object `path@offset`, the offset of the line's first byte, since the line numbers
//! before the range are not known). Objects are streamed, so
//! a worker's memory does not grow with their size; `.gz` and `.zst` objects are decompressed.
//! Progress ([`FileProgress`]) is the object, the byte offset and the line number: a new owner
//! of a split resumes mid-object (by a ranged read; a compressed object is read again from its
//! start and the lines already done are skipped).

use std::sync::Arc;

use bytes::Bytes;
use etl_coordination_driver::{
    LaneInfo, NextRecord, Plan, PlanError, PlanKind, PlannedSplit, Planner, Source, SourceError, SplitId,
    SplitReader, error_chain,
};
use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

use crate::Line;

/// Default target bytes per split (the product document suggests tens of MB to ~128 MB).
pub const DEFAULT_SPLIT_BYTES: u64 = 64 * 1024 * 1024;

/// The input cannot be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FilesError {
    /// A local location that is not a directory.
    #[error("input directory {0:?} does not exist or is not a directory")]
    NotADirectory(String),
    /// An object-store URL that cannot be opened (malformed, or the `cloud` feature is off).
    #[error("cannot open {location:?}: {reason} (object-store URLs need the `cloud` feature)")]
    Url {
        /// The location.
        location: String,
        /// Why.
        reason: String,
    },
    /// A split size of 0.
    #[error("split_bytes must be at least 1")]
    ZeroSplitBytes,
    /// An `--include` or `--exclude` pattern that is not a valid glob.
    #[error("glob {pattern:?}: {reason}")]
    Glob {
        /// The pattern as given.
        pattern: String,
        /// Why it is not a glob.
        reason: String,
    },
    /// An object that is not a readable Parquet file, for the Parquet source's planner.
    #[error(
        "{path}: cannot read its Parquet footer: {reason} (if it is not Parquet, leave it out with \
         --exclude, or choose the input with --include '**/*.parquet')"
    )]
    Footer {
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
    /// An object's footer could not be fetched (the store failed, not the file).
    #[error("{path}: reading its Parquet footer: {reason}")]
    FooterRead {
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
    /// Listing the input failed.
    #[error("listing {location}: {reason}")]
    List {
        /// The location.
        location: String,
        /// Why.
        reason: String,
    },
}

/// Where the files are and how to split them.
#[derive(Clone)]
pub struct FilesSource {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    location: String,
    split_bytes: u64,
    follow: bool,
    filter: KeyFilter,
    ranges: bool,
}

/// Which objects under the location are input (see [`FilesSource::include`]).
#[derive(Clone, Debug, Default)]
struct KeyFilter {
    include: Vec<String>,
    exclude: Vec<String>,
    include_hidden: bool,
    include_set: Option<globset::GlobSet>,
    exclude_set: Option<globset::GlobSet>,
}

impl KeyFilter {
    /// Whether the object at `key` (relative to the location) is input.
    fn admits(&self, key: &str) -> bool {
        if !self.include_hidden && is_hidden(key) {
            return false;
        }
        if self.include_set.as_ref().is_some_and(|set| !set.is_match(key)) {
            return false;
        }
        !self.exclude_set.as_ref().is_some_and(|set| set.is_match(key))
    }

    /// What changes the plan, for the fingerprint (empty when nothing is set).
    fn describe(&self) -> String {
        let mut out = String::new();
        for (name, patterns) in [("include", &self.include), ("exclude", &self.exclude)] {
            let mut sorted: Vec<&String> = patterns.iter().collect();
            sorted.sort();
            sorted.dedup();
            for p in sorted {
                out.push_str(&format!(" {name}={}", serde_json::to_string(p).expect("strings serialize")));
            }
        }
        if self.include_hidden {
            out.push_str(" include_hidden");
        }
        out
    }
}

/// Spark's rule for what is not data (its `InMemoryFileIndex`): a key with a component that
/// starts with `.`, or with `_` unless it holds a `=` (a partition column such as `_c=1`), or
/// that ends in `._COPYING_` (a copy in progress): `_SUCCESS`, `_committed_123`,
/// `_temporary/...`, `.part-0000.crc`, `.DS_Store`.
pub fn is_hidden(key: &str) -> bool {
    key.split('/')
        .any(|c| c.starts_with('.') || (c.starts_with('_') && !c.contains('=')) || c.ends_with("._COPYING_"))
}

fn glob_set(patterns: &[String]) -> Result<Option<globset::GlobSet>, FilesError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = globset::GlobSetBuilder::new();
    for p in patterns {
        let glob = globset::GlobBuilder::new(p)
            .literal_separator(true)
            .build()
            .map_err(|e| FilesError::Glob { pattern: p.clone(), reason: e.kind().to_string() })?;
        b.add(glob);
    }
    b.build().map(Some).map_err(|e| FilesError::Glob { pattern: patterns.join(" "), reason: e.to_string() })
}

impl std::fmt::Debug for FilesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesSource")
            .field("location", &self.location)
            .field("split_bytes", &self.split_bytes)
            .field("follow", &self.follow)
            .field("filter", &self.filter.describe())
            .field("ranges", &self.ranges)
            .finish()
    }
}

/// A split's descriptor: its objects and their sizes when planned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSplit {
    /// `(path, size)` in read order.
    pub objects: Vec<(String, u64)>,
    /// A byte range of the split's one object ([`FilesSource::split_large_objects`]): the split
    /// owns the lines that start inside it. Absent (and not written) for whole objects, so a
    /// whole-object descriptor reads as it always did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<ByteRange>,
}

/// `[start, end)` bytes of an object: the lines that start there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteRange {
    /// First byte.
    pub start: u64,
    /// One past the last byte a line may start at.
    pub end: u64,
}

/// Progress within a split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileProgress {
    /// Index of the object being read.
    pub object: usize,
    /// Bytes of that object read (decompressed bytes for a compressed object).
    pub offset: u64,
    /// Lines of that object read.
    pub line: u64,
}

impl FilesSource {
    /// A backfill of `location`: a local directory, or (feature `cloud`) an object-store URL
    /// whose credentials come from the environment as the cloud SDKs read them (`AWS_*`,
    /// `GOOGLE_*`, `AZURE_*`).
    pub fn open(location: &str, split_bytes: u64) -> Result<Self, FilesError> {
        if split_bytes == 0 {
            return Err(FilesError::ZeroSplitBytes);
        }
        let (store, prefix): (Arc<dyn ObjectStore>, ObjectPath) = if location.contains("://") {
            let bad = |reason: String| FilesError::Url { location: location.to_owned(), reason };
            let url = url::Url::parse(location).map_err(|e| bad(e.to_string()))?;
            let options = std::env::vars()
                .filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_"].iter().any(|p| k.starts_with(p)))
                .map(|(k, v)| (k.to_ascii_lowercase(), v));
            let (store, path) =
                object_store::parse_url_opts(&url, options).map_err(|e| bad(error_chain(&e)))?;
            (Arc::from(store), path)
        } else {
            let dir = std::path::Path::new(location);
            if !dir.is_dir() {
                return Err(FilesError::NotADirectory(location.to_owned()));
            }
            let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(|_| FilesError::NotADirectory(location.to_owned()))?;
            (Arc::new(fs), ObjectPath::default())
        };
        Ok(FilesSource {
            store,
            prefix,
            location: location.to_owned(),
            split_bytes,
            follow: false,
            filter: KeyFilter::default(),
            ranges: false,
        })
    }

    /// Follow mode: every object is a split, and the plan stays open (see the module
    /// documentation). The job never completes; it ends when its workers are drained.
    pub fn follow(mut self) -> Self {
        self.follow = true;
        self
    }

    /// Only objects whose key (relative to the location, `/`-separated) matches one of these
    /// globs are input (`*` and `?` stay within a path component, `**` crosses them:
    /// `**/*.json`, `2024-*/part-*`). Replaces any earlier include list.
    pub fn include(mut self, globs: &[String]) -> Result<Self, FilesError> {
        self.filter.include_set = glob_set(globs)?;
        self.filter.include = globs.to_vec();
        Ok(self)
    }

    /// Objects whose key matches one of these globs are not input (applied after
    /// [`FilesSource::include`]). Replaces any earlier exclude list.
    pub fn exclude(mut self, globs: &[String]) -> Result<Self, FilesError> {
        self.filter.exclude_set = glob_set(globs)?;
        self.filter.exclude = globs.to_vec();
        Ok(self)
    }

    /// Cut uncompressed objects larger than the split target into byte ranges of about the
    /// target, one split each, so that one big object is read by several workers. A range owns
    /// the lines that start inside it: a line that straddles a boundary is read whole by the
    /// range it starts in, and its bytes past the boundary are skipped by the next one.
    /// Compressed objects stay whole (a compressed stream cannot be entered mid-way). Lines of
    /// a ranged split are keyed `path@offset` (their byte offset), since the line number of a
    /// range's first line is not known without reading what precedes it.
    pub fn split_large_objects(mut self, yes: bool) -> Self {
        self.ranges = yes;
        self
    }

    /// Read hidden objects too. By default a key with a component that starts with `_` or `.`
    /// is skipped, as Hadoop and Spark do: commit markers (`_SUCCESS`, `_committed_*`,
    /// `_started_*`), temporary output (`_temporary/`), checksums (`.part-0000.crc`).
    pub fn include_hidden(mut self, yes: bool) -> Self {
        self.filter.include_hidden = yes;
        self
    }

    /// The store the objects are read from.
    #[cfg(feature = "parquet")]
    pub(crate) fn store(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }

    /// The split target in bytes.
    #[cfg(feature = "parquet")]
    pub(crate) fn split_bytes(&self) -> u64 {
        self.split_bytes
    }

    /// The objects under the location that are input, in path order.
    pub(crate) async fn list(&self) -> Result<Vec<(String, u64)>, FilesError> {
        let prefix = self.prefix.as_ref();
        let mut objects: Vec<(String, u64)> = self
            .store
            .list(Some(&self.prefix))
            .try_filter_map(|m| {
                let path = m.location.to_string();
                let key = path.strip_prefix(prefix).unwrap_or(&path).trim_start_matches('/');
                let admitted = self.filter.admits(key);
                std::future::ready(Ok(admitted.then_some((path, m.size))))
            })
            .try_collect()
            .await
            .map_err(|e| FilesError::List { location: self.location.clone(), reason: error_chain(&e) })?;
        objects.sort();
        Ok(objects)
    }

    /// Lists the input and cuts it into splits (see the module documentation).
    pub async fn plan_splits(&self) -> Result<Vec<PlannedSplit>, FilesError> {
        let objects = self.list().await?;
        Ok(if self.follow {
            objects.into_iter().map(|(p, s)| split_of(vec![(p.clone(), s)], None, &[&p])).collect()
        } else if self.ranges {
            let (large, small): (Vec<_>, Vec<_>) = objects
                .into_iter()
                .partition(|(p, size)| *size > self.split_bytes && compression(p) == Compression::None);
            let mut splits = pack(small, self.split_bytes);
            for (path, size) in large {
                splits.extend(ranges_of(&path, size, self.split_bytes));
            }
            splits
        } else {
            pack(objects, self.split_bytes)
        })
    }
}

/// The byte-range splits of one object of `size` bytes: `ceil(size / target)` ranges of equal
/// size (the last takes the remainder), each split's id a hash of the path, size and range.
pub fn ranges_of(path: &str, size: u64, target: u64) -> Vec<PlannedSplit> {
    let count = size.div_ceil(target.max(1)).max(1);
    let step = size.div_ceil(count);
    (0..count)
        .map(|i| {
            let range = ByteRange { start: i * step, end: ((i + 1) * step).min(size) };
            let identity = format!("{path}\0{size}\0{}\0{}", range.start, range.end);
            split_of(vec![(path.to_owned(), size)], Some(range), &[&identity])
        })
        .filter(|s| s.weight > 0)
        .collect()
}

/// A split of `objects` (a byte `range` of its one object, if given), its id a hash of
/// `identity`.
fn split_of(objects: Vec<(String, u64)>, range: Option<ByteRange>, identity: &[&str]) -> PlannedSplit {
    let h = fnv(identity.iter().copied());
    let weight = match range {
        Some(r) => r.end - r.start,
        None => objects.iter().map(|(_, s)| *s).sum::<u64>().max(1),
    };
    let descriptor = Bytes::from(serde_json::to_vec(&FileSplit { objects, range }).expect("serializable"));
    PlannedSplit::new(SplitId::new(format!("f-{h:016x}")).expect("hex ids are valid"), descriptor, weight)
}

/// FNV-1a of `parts`, each followed by a zero byte: a split id stable across releases.
pub(crate) fn fnv<'a>(parts: impl Iterator<Item = &'a str>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.flat_map(|s| s.bytes().chain([0])) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The most a split's descriptor holds, in bytes of its JSON (the object list; the wrapper
/// adds a few bytes): a split of many small objects is
/// cut there whatever its size in bytes (30,000 objects of a few bytes under one 64 MiB target
/// would otherwise make a descriptor of megabytes, above any store's value limit), so a
/// descriptor stays far below [`etl_coordination_driver::MAX_DESCRIPTOR_LEN`] and quick to read
/// at every claim.
pub const DESCRIPTOR_BUDGET: usize = 64 * 1024;

/// Greedy bin-packing in path order: objects join the current split until it would exceed the
/// target in bytes, or its descriptor [`DESCRIPTOR_BUDGET`]; an object larger than the target
/// gets a split of its own. A split's id is a hash of its paths and sizes.
pub fn pack(objects: Vec<(String, u64)>, target: u64) -> Vec<PlannedSplit> {
    let mut splits = Vec::new();
    let mut current: Vec<(String, u64)> = Vec::new();
    let mut bytes = 0u64;
    let flush = |current: &mut Vec<(String, u64)>, splits: &mut Vec<PlannedSplit>| {
        if current.is_empty() {
            return;
        }
        let objects = std::mem::take(current);
        let identity: Vec<String> = objects.iter().map(|(p, s)| format!("{p}\0{s}")).collect();
        let identity: Vec<&str> = identity.iter().map(String::as_str).collect();
        splits.push(split_of(objects, None, &identity));
    };
    let mut described = 0usize;
    for (path, size) in objects {
        // Its entry in the descriptor: `["path",size],`, the path as JSON escapes it.
        let entry =
            serde_json::to_string(&path).map_or(path.len() * 6 + 2, |q| q.len()) + size.to_string().len() + 4;
        if !current.is_empty() && (bytes + size > target || described + entry > DESCRIPTOR_BUDGET) {
            flush(&mut current, &mut splits);
            bytes = 0;
            described = 0;
        }
        bytes += size;
        described += entry;
        current.push((path, size));
    }
    flush(&mut current, &mut splits);
    splits
}

impl Planner for FilesSource {
    fn fingerprint(&self) -> String {
        let mode = if self.follow { " follow" } else { "" };
        // Filters change the plan, so they are part of the fingerprint. Skipping hidden keys by
        // default is not: it changes which objects a plan lists, not how a descriptor reads, and
        // a final plan is made once, so in a rolling update whichever release's leader planned
        // decides and both read the result.
        let filter = self.filter.describe();
        let ranges = if self.ranges && !self.follow { " ranges" } else { "" };
        format!("files/v1 location={} split_bytes={}{mode}{filter}{ranges}", self.location, self.split_bytes)
    }

    async fn plan(&self) -> Result<Plan, PlanError> {
        let splits = self.plan_splits().await.map_err(|e| PlanError::from_error(&e))?;
        Ok(Plan::new(if self.follow { PlanKind::Open } else { PlanKind::Final }, splits))
    }
}

impl Source for FilesSource {
    type Record = Line;
    type Progress = FileProgress;
    type Reader = FilesReader;

    async fn open(&self, lane: &LaneInfo, from: Option<FileProgress>) -> Result<FilesReader, SourceError> {
        let split: FileSplit = serde_json::from_slice(lane.descriptor())
            .map_err(|e| SourceError::unprocessable(format!("undecodable files descriptor: {e}")))?;
        let before = split
            .objects
            .iter()
            .scan(0u64, |sum, (_, size)| {
                let at = *sum;
                *sum += size;
                Some(at)
            })
            .collect();
        Ok(FilesReader {
            store: self.store.clone(),
            split,
            before,
            progress: from.unwrap_or_default(),
            current: None,
        })
    }
}

/// The object being read: its lines, and how many lines to skip first (resuming a compressed
/// object).
struct Current {
    lines: Box<dyn AsyncBufRead + Send + Unpin>,
    skip: u64,
    buf: Vec<u8>,
    /// A byte range's first read starts one byte before the range and is discarded through
    /// the first line end: the line in progress there belongs to the range before.
    align: bool,
}

/// Reads a files split line by line, streaming each object.
pub struct FilesReader {
    store: Arc<dyn ObjectStore>,
    split: FileSplit,
    /// The bytes of the objects before each (what [`SplitReader::position`] adds up).
    before: Vec<u64>,
    progress: FileProgress,
    current: Option<Current>,
}

/// How an object is compressed, by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Zstd,
}

fn compression(path: &str) -> Compression {
    if path.ends_with(".gz") {
        Compression::Gzip
    } else if path.ends_with(".zst") {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// Opens the object `path` of `size` bytes at `progress` as a stream of lines.
/// How far past a byte range's end its first request reads: the last line a range owns ends
/// past the range; most lines end within this, and a longer one is read on by a second request.
const RANGE_SLACK: u64 = 64 * 1024;

/// The bytes `start..end` of `path` as one stream of I/O results.
fn get_bytes(
    store: Arc<dyn ObjectStore>,
    path: String,
    start: u64,
    end: u64,
) -> futures_util::stream::BoxStream<'static, std::io::Result<Bytes>> {
    futures_util::stream::once(async move {
        let options = GetOptions { range: Some(GetRange::Bounded(start..end)), ..GetOptions::default() };
        match store.get_opts(&ObjectPath::from(path.as_str()), options).await {
            Ok(got) => got.into_stream().map(|r| r.map_err(std::io::Error::other)).boxed(),
            Err(e) => futures_util::stream::once(async move { Err(std::io::Error::other(e)) }).boxed(),
        }
    })
    .flatten()
    .boxed()
}

/// Opens the object `path` of `size` bytes at `progress` as a stream of lines; `until` (a byte
/// range's end) bounds the first request to a little past it, and the rest of the object is
/// requested only if a line goes on beyond that (a range never requests the whole object).
async fn open_object(
    store: Arc<dyn ObjectStore>,
    path: &str,
    size: u64,
    progress: FileProgress,
    until: Option<u64>,
) -> Result<Current, SourceError> {
    let kind = compression(path);
    // A plain object resumes at its byte offset; a compressed one is read from its start.
    let start = if kind == Compression::None { progress.offset } else { 0 };
    let window = until.map_or(size, |end| end.saturating_add(RANGE_SLACK).min(size)).max(start);
    // The first request is made now, so that its failure (a missing object, a forbidden one)
    // is the open's.
    let options = GetOptions { range: Some(GetRange::Bounded(start..window)), ..GetOptions::default() };
    let got = store.get_opts(&ObjectPath::from(path), options).await.map_err(|e| store_error(path, e))?;
    let mut bytes = got.into_stream().map(|r| r.map_err(std::io::Error::other)).boxed();
    if window < size {
        bytes = bytes.chain(get_bytes(store, path.to_owned(), window, size)).boxed();
    }
    let raw = tokio_util::io::StreamReader::new(bytes);
    let lines: Box<dyn AsyncBufRead + Send + Unpin> = match kind {
        Compression::None => Box::new(raw),
        Compression::Gzip => {
            let mut d = async_compression::tokio::bufread::GzipDecoder::new(raw);
            d.multiple_members(true);
            Box::new(BufReader::new(d))
        }
        Compression::Zstd => {
            let mut d = async_compression::tokio::bufread::ZstdDecoder::new(raw);
            d.multiple_members(true);
            Box::new(BufReader::new(d))
        }
    };
    let skip = if kind == Compression::None { 0 } else { progress.line };
    Ok(Current { lines, skip, buf: Vec::new(), align: false })
}

/// An object store's error as a source reports it: what retrying cannot change (missing,
/// forbidden, unauthenticated, unsupported) fails the tenancy; anything else (a server error
/// or throttling the client's own retries did not get past, a connection that dropped) is an
/// outage, waited out in place.
pub(crate) fn store_error(path: &str, e: object_store::Error) -> SourceError {
    use object_store::Error as E;
    let msg = format!("reading {path}: {e}");
    match e {
        E::NotFound { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::AlreadyExists { .. }
        | E::Precondition { .. }
        | E::NotModified { .. }
        | E::NotImplemented
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::UnknownConfigurationKey { .. } => SourceError::failed(msg),
        // A local file system's I/O error is judged by its kind (a file cut short or unreadable
        // is not an outage); a remote store's (a server error, throttling past the client's own
        // retries, a connection dropped) is.
        ref other if is_local(other) => match io_kind(other) {
            Some(kind) if etl_coordination_driver::is_transient_io(kind) => SourceError::transient(msg),
            _ => SourceError::failed(msg),
        },
        _ => SourceError::transient(msg),
    }
}

/// The kind of the first I/O error in `e`'s source chain.
fn io_kind(e: &object_store::Error) -> Option<std::io::ErrorKind> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = cur {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cur = s.source();
    }
    None
}

/// Whether `e` comes from the local file system store (its errors other than I/O ones, such as
/// a range past a file's end, are the file's, never an outage).
fn is_local(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::Generic { store, .. } if *store == "LocalFileSystem")
}

impl SplitReader for FilesReader {
    type Record = Line;
    type Progress = FileProgress;

    /// Bytes of the split before `p`, as the planner weighs it: the objects before, and the
    /// offset within the current one (a byte range counts from its start). A compressed
    /// object's offset counts decompressed bytes, so it counts as nothing until it is read.
    fn position(&self, p: &FileProgress) -> Option<u64> {
        if let Some(r) = self.split.range {
            // Past its one object: the whole range.
            let at = if p.object > 0 { r.end } else { p.offset };
            return Some(at.saturating_sub(r.start).min(r.end - r.start));
        }
        let Some((path, size)) = self.split.objects.get(p.object) else {
            // Past the last object: all of it.
            return Some(self.split.objects.iter().map(|(_, size)| *size).sum());
        };
        let within = if compression(path) == Compression::None { p.offset.min(*size) } else { 0 };
        Some(self.before[p.object] + within)
    }

    async fn next(&mut self) -> NextRecord<Line, FileProgress> {
        loop {
            let Some((path, size)) = self.split.objects.get(self.progress.object).cloned() else {
                return Ok(None);
            };
            let next_object = FileProgress { object: self.progress.object + 1, offset: 0, line: 0 };
            let range = self.split.range;
            // A range is done once the next line would start at or past its end.
            if range.is_some_and(|r| self.progress.offset >= r.end) {
                self.current = None;
                self.progress = next_object;
                continue;
            }
            if self.current.is_none() {
                // An empty object has no lines (and no compressed stream to decode).
                if size == 0 || (compression(&path) == Compression::None && self.progress.offset >= size) {
                    self.progress = next_object;
                    continue;
                }
                let (at, align) = match range {
                    Some(r) if r.start > 0 && self.progress.offset < r.start => (r.start - 1, true),
                    _ => (self.progress.offset, false),
                };
                if range.is_some() && compression(&path) != Compression::None {
                    return Err(SourceError::unprocessable(format!(
                        "{path}: a byte range of a compressed object cannot be read (plan it whole)"
                    )));
                }
                let from = FileProgress { offset: at, ..self.progress };
                let until = range.map(|r| r.end);
                let mut opened = open_object(self.store.clone(), &path, size, from, until).await?;
                opened.align = align;
                if align {
                    self.progress.offset = at;
                }
                self.current = Some(opened);
            }
            let c = self.current.as_mut().expect("opened above");
            c.buf.clear();
            let n = c.lines.read_until(b'\n', &mut c.buf).await.map_err(|e| match e.kind() {
                // Not gzip or zstd after all, or truncated: every try would fail the same way.
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof => {
                    SourceError::unprocessable(format!("decoding {path}: {e}"))
                }
                // The object store's body stream failed (a reset, a timeout: classified as its
                // errors are), or an outage of the local disk: read again from the record after
                // the last one written. A decoder's error (corrupt gzip or zstd) is not.
                _ if e.get_ref().and_then(|i| i.downcast_ref::<object_store::Error>()).is_some() => {
                    let inner =
                        e.into_inner().expect("checked").downcast::<object_store::Error>().expect("checked");
                    store_error(&path, *inner)
                }
                k if etl_coordination_driver::is_transient_io(k) => {
                    SourceError::transient(format!("reading {path}: {e}"))
                }
                _ => SourceError::failed(format!("reading {path}: {e}")),
            })?;
            if n == 0 {
                self.current = None;
                self.progress = next_object;
                continue;
            }
            if c.skip > 0 {
                c.skip -= 1;
                continue;
            }
            let line_start = self.progress.offset;
            self.progress.offset += n as u64;
            if std::mem::take(&mut c.align) {
                continue; // the tail of the range before's last line (or the byte before ours)
            }
            debug_assert!(range.is_none_or(|r| line_start < r.end), "checked before reading");
            self.progress.line += 1;
            // Lines are text: bytes that are not UTF-8 are refused, never silently replaced.
            let content = match std::str::from_utf8(&c.buf) {
                Ok(text) => text.trim_end_matches(['\n', '\r']).to_owned(),
                // A bad record: the reader is past it (its progress counts it), so a skipping
                // lane goes on with the next line.
                Err(e) => {
                    let raw = c.buf.strip_suffix(b"\n").unwrap_or(&c.buf);
                    return Err(SourceError::bad_record(
                        match range {
                            Some(_) => format!("{path}@{line_start}"),
                            None => format!("{path}:{}", self.progress.line),
                        },
                        format!("not UTF-8 ({e}); convert the object to UTF-8"),
                        raw.to_vec(),
                    ));
                }
            };
            let key = match range {
                Some(_) => format!("{path}@{line_start}"),
                None => format!("{path}:{}", self.progress.line),
            };
            return Ok(Some((Line { key, content }, self.progress)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use etl_coordination_driver::{Epoch, InstanceId};

    use super::*;

    /// What retrying cannot change fails the tenancy; a remote store's other errors are
    /// outages; the local file system's are judged by their I/O kind (a file cut short or
    /// unreadable is not an outage, a full disk is).
    #[test]
    fn object_store_errors_are_outages_only_when_retrying_can_help() {
        use object_store::Error as E;
        let boxed = |e: std::io::Error| -> Box<dyn std::error::Error + Send + Sync> { Box::new(e) };
        let io = |k: std::io::ErrorKind| std::io::Error::from(k);
        let not_found = E::NotFound { path: "a".into(), source: boxed(io(std::io::ErrorKind::NotFound)) };
        assert!(matches!(store_error("a", not_found), SourceError::Failed(_)));
        let denied =
            E::PermissionDenied { path: "a".into(), source: boxed(io(std::io::ErrorKind::PermissionDenied)) };
        assert!(matches!(store_error("a", denied), SourceError::Failed(_)));
        let throttled = E::Generic { store: "S3", source: "503 SlowDown after 10 retries".into() };
        assert!(store_error("a", throttled).is_transient());
        let reset = E::Generic { store: "S3", source: boxed(io(std::io::ErrorKind::ConnectionReset)) };
        assert!(store_error("a", reset).is_transient());
        let bad_range = E::Generic { store: "LocalFileSystem", source: "range 10..20 past the end".into() };
        assert!(matches!(store_error("a", bad_range), SourceError::Failed(_)));
        let full =
            E::Generic { store: "LocalFileSystem", source: boxed(io(std::io::ErrorKind::StorageFull)) };
        assert!(store_error("a", full).is_transient(), "a full local disk is an outage");
    }

    /// The shape of a Spark output prefix: 30,000 objects of a few hundred bytes under the
    /// default 64 MiB target used to make one split with a descriptor of megabytes, which no
    /// store accepts. Splits are cut by descriptor size too; every object is in exactly one.
    #[test]
    fn many_small_objects_make_splits_whose_descriptors_stay_small() {
        let objects: Vec<(String, u64)> =
            (0..30_000).map(|i| (format!("events/date=2024-01-01/part-{i:06}-c000.json"), 300)).collect();
        let splits = pack(objects.clone(), DEFAULT_SPLIT_BYTES);
        assert!(splits.len() > 1, "cut by descriptor size, not one split");
        let mut seen = Vec::new();
        for s in &splits {
            assert!(s.descriptor.len() <= DESCRIPTOR_BUDGET, "{} bytes", s.descriptor.len());
            assert!(s.descriptor.len() <= etl_coordination_driver::MAX_DESCRIPTOR_LEN);
            let d: FileSplit = serde_json::from_slice(&s.descriptor).unwrap();
            seen.extend(d.objects);
        }
        assert_eq!(seen, objects, "every object once, in order");
        // Paths that escape to six bytes a character still fit.
        let odd: Vec<(String, u64)> = (0..2_000).map(|i| (format!("{}{i}", "\u{1}".repeat(40)), 1)).collect();
        assert!(pack(odd, DEFAULT_SPLIT_BYTES).iter().all(|s| s.descriptor.len() <= DESCRIPTOR_BUDGET));
    }

    #[test]
    fn hidden_keys_are_those_hadoop_and_spark_skip() {
        for hidden in [
            "_SUCCESS",
            "_committed_123",
            "_temporary/0/part-0",
            ".part-0000.json.crc",
            "a/.DS_Store",
            "part-1.json._COPYING_",
        ] {
            assert!(is_hidden(hidden), "{hidden}");
        }
        for data in
            ["part-0000.json", "date=2024-01-01/part-1.json", "a_b/c.txt", "x.crc", "_col=1/part-0.json"]
        {
            assert!(!is_hidden(data), "{data}");
        }
    }

    #[tokio::test]
    async fn filters_choose_the_input_and_change_the_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["a.json", "b.csv", "sub/c.json", "sub/d.json.tmp", "_SUCCESS", "sub/.c.json.crc"] {
            let path = dir.path().join(f);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, "x\n").unwrap();
        }
        let location = dir.path().to_str().unwrap();
        let keys = |src: &FilesSource| {
            let src = src.clone();
            async move {
                let mut keys: Vec<String> = src.list().await.unwrap().into_iter().map(|(p, _)| p).collect();
                keys.sort();
                keys
            }
        };
        let plain = FilesSource::open(location, 1 << 20).unwrap();
        assert_eq!(
            keys(&plain).await,
            ["a.json", "b.csv", "sub/c.json", "sub/d.json.tmp"],
            "markers skipped"
        );
        let all = plain.clone().include_hidden(true);
        assert_eq!(keys(&all).await.len(), 6);
        let json = plain.clone().include(&["**/*.json".into()]).unwrap();
        assert_eq!(keys(&json).await, ["a.json", "sub/c.json"]);
        let top = plain.clone().include(&["*.json".into()]).unwrap();
        assert_eq!(keys(&top).await, ["a.json"], "* stays within a path component");
        let no_tmp = plain.clone().exclude(&["**/*.tmp".into(), "*.csv".into()]).unwrap();
        assert_eq!(keys(&no_tmp).await, ["a.json", "sub/c.json"]);
        assert_ne!(json.fingerprint(), plain.fingerprint(), "another input is another job");
        let ab = plain.clone().include(&["*.a".into(), "*.b".into()]).unwrap();
        let ba = plain.clone().include(&["*.b".into(), "*.a".into()]).unwrap();
        assert_eq!(ab.fingerprint(), ba.fingerprint(), "the order of the globs does not matter");
        let braces = plain.clone().include(&["**/*.{json,csv}".into()]).unwrap();
        assert_eq!(keys(&braces).await, ["a.json", "b.csv", "sub/c.json"]);
        assert_eq!(plain.fingerprint(), FilesSource::open(location, 1 << 20).unwrap().fingerprint());
        let err = plain.include(&["[oops".into()]).unwrap_err().to_string();
        assert!(err.contains("[oops"), "{err}");
    }

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

    /// The lines a fresh reader of `split` yields from `from`, with the progress after each.
    async fn read_all(
        src: &FilesSource,
        split: &PlannedSplit,
        from: Option<FileProgress>,
    ) -> Vec<(Line, FileProgress)> {
        let lane = LaneInfo::new(
            split.id.clone(),
            Epoch(1),
            InstanceId::new("t").unwrap(),
            split.descriptor.clone(),
            1,
        );
        let mut r = src.open(&lane, from).await.unwrap();
        let mut out = Vec::new();
        while let Some(rec) = r.next().await.unwrap() {
            out.push(rec);
        }
        out
    }

    #[tokio::test]
    async fn positions_climb_to_the_weight_by_bytes_read() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "one\ntwo\n").unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"four\nfive\n").unwrap();
        std::fs::write(dir.path().join("c.txt.gz"), gz.finish().unwrap()).unwrap();
        let gz_size = std::fs::metadata(dir.path().join("c.txt.gz")).unwrap().len();
        // Each object a split of its own (target 1 byte), and a.txt in 4-byte ranges.
        for ranges in [false, true] {
            let src = FilesSource::open(dir.path().to_str().unwrap(), if ranges { 4 } else { 1 })
                .unwrap()
                .split_large_objects(ranges);
            for split in src.plan_splits().await.unwrap() {
                let desc: FileSplit = serde_json::from_slice(&split.descriptor).unwrap();
                let lane = LaneInfo::new(
                    split.id.clone(),
                    Epoch(1),
                    InstanceId::new("t").unwrap(),
                    split.descriptor.clone(),
                    1,
                );
                let r = src.open(&lane, None).await.unwrap();
                let read = read_all(&src, &split, None).await;
                let positions: Vec<u64> = read.iter().map(|(_, p)| r.position(p).unwrap()).collect();
                let end = FileProgress { object: desc.objects.len(), offset: 0, line: 0 };
                assert_eq!(r.position(&end), Some(split.weight), "{desc:?}");
                let expected: Vec<u64> = match (desc.objects[0].0.as_str(), desc.range) {
                    ("a.txt", None) => vec![4, 8],
                    // Each range's one line; the first ends on its range's end, the second's
                    // read starts a byte early and counts from the range's start.
                    ("a.txt", Some(_)) => vec![4],
                    // Decompressed bytes say nothing of the compressed size: done at the end.
                    ("c.txt.gz", None) => vec![0, 0],
                    other => panic!("unexpected split {other:?}"),
                };
                assert_eq!(positions, expected, "{desc:?}");
                if desc.objects[0].0 == "c.txt.gz" {
                    assert_eq!(split.weight, gz_size);
                }
            }
        }
    }

    /// Every line of `text` (the reader's semantics: a last line without its newline counts).
    fn lines_of(text: &str) -> Vec<String> {
        text.split_inclusive('\n').map(|l| l.trim_end_matches(['\n', '\r']).to_owned()).collect()
    }

    /// Plans one object at `target` with byte ranges, and reads every range (and, from each
    /// range's `resume_at`-th record, a resumed reader).
    async fn ranged_lines(text: &str, target: u64, resume_at: usize) -> (Vec<String>, usize) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("big.txt"), text).unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), target).unwrap().split_large_objects(true);
        let mut splits = src.plan_splits().await.unwrap();
        let start = |s: &PlannedSplit| {
            serde_json::from_slice::<FileSplit>(&s.descriptor).unwrap().range.map_or(0, |r| r.start)
        };
        splits.sort_by_key(start);
        let mut out = Vec::new();
        for split in &splits {
            let all = read_all(&src, split, None).await;
            if let Some((_, progress)) = all.get(resume_at) {
                let rest = read_all(&src, split, Some(*progress)).await;
                assert_eq!(
                    rest.iter().map(|(l, _)| &l.key).collect::<Vec<_>>(),
                    all[resume_at + 1..].iter().map(|(l, _)| &l.key).collect::<Vec<_>>(),
                    "a resume after record {resume_at} reads the rest of its range"
                );
            }
            out.extend(all.into_iter().map(|(l, _)| l.content));
        }
        (out, splits.len())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// For random lines (empty ones, long ones, no final newline) and random split targets,
        /// every line is read by exactly one range, in order, and resuming mid-range loses and
        /// repeats nothing.
        #[test]
        fn byte_ranges_read_every_line_exactly_once(
            lines in proptest::collection::vec("[a-z]{0,40}", 0..60),
            final_newline in proptest::bool::ANY,
            target in 1u64..120,
            resume_at in 0usize..4,
        ) {
            let mut text = lines.join("\n");
            if final_newline && !text.is_empty() {
                text.push('\n');
            }
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let (read, _) = rt.block_on(ranged_lines(&text, target, resume_at));
            proptest::prop_assert_eq!(read, lines_of(&text));
        }
    }

    #[tokio::test]
    async fn a_big_object_is_cut_in_ranges_and_a_line_across_a_boundary_is_read_once() {
        // 10 lines of 10 bytes; ranges of 25 bytes start mid-line.
        let text: String = (0..10).map(|i| format!("line-{i:03}\n")).collect();
        let (read, splits) = ranged_lines(&text, 25, 1).await;
        assert_eq!(splits, 4, "100 bytes at 25 a split");
        assert_eq!(read, lines_of(&text));
        // A boundary exactly at a line start, and a line longer than a range.
        let (read, _) = ranged_lines("aaaa\nbbbb\n", 5, 0).await;
        assert_eq!(read, ["aaaa", "bbbb"]);
        let long = format!("{}\nshort\n", "x".repeat(100));
        let (read, splits) = ranged_lines(&long, 10, 0).await;
        assert!(splits > 5);
        assert_eq!(read, [&"x".repeat(100), "short"]);
        // A line that goes on past a range's first request (its end and RANGE_SLACK): the rest
        // of the object is requested then.
        let huge = "y".repeat(3 * RANGE_SLACK as usize);
        let text = format!("a\n{huge}\nb\n{huge}\n");
        let (read, splits) = ranged_lines(&text, RANGE_SLACK / 2, 0).await;
        assert!(splits > 4);
        assert_eq!(read, ["a", &huge, "b", &huge]);
    }

    #[tokio::test]
    async fn compressed_and_small_objects_stay_whole_and_the_option_is_in_the_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&vec![b'x'; 1000]).unwrap();
        std::fs::write(dir.path().join("a.txt.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(dir.path().join("b.txt"), "small\n").unwrap();
        let location = dir.path().to_str().unwrap();
        let src = FilesSource::open(location, 4).unwrap().split_large_objects(true);
        let splits = src.plan_splits().await.unwrap();
        for s in &splits {
            let d: FileSplit = serde_json::from_slice(&s.descriptor).unwrap();
            assert!(d.range.is_none() || d.objects[0].0 == "b.txt", "{d:?}");
        }
        assert!(splits.iter().any(|s| String::from_utf8_lossy(&s.descriptor).contains("a.txt.gz")));
        assert_ne!(src.fingerprint(), FilesSource::open(location, 4).unwrap().fingerprint());
        // A whole-object descriptor is byte for byte what it was before ranges existed.
        let plain = FilesSource::open(location, 1 << 20).unwrap().plan_splits().await.unwrap();
        assert!(!String::from_utf8_lossy(&plain[0].descriptor).contains("range"));
    }

    #[tokio::test]
    async fn a_reader_resumes_mid_object_from_its_progress() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "one\ntwo\nthree\n").unwrap();
        std::fs::write(dir.path().join("b.txt"), "four\nfive").unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let splits = src.plan_splits().await.unwrap();
        assert_eq!(splits.len(), 1);
        let all = read_all(&src, &splits[0], None).await;
        let keys: Vec<&str> = all.iter().map(|(l, _)| l.key.as_str()).collect();
        assert_eq!(keys, ["a.txt:1", "a.txt:2", "a.txt:3", "b.txt:1", "b.txt:2"]);
        assert_eq!(all[1].0.content, "two");
        // A new owner resumes after "two".
        let rest = read_all(&src, &splits[0], Some(all[1].1)).await;
        let keys: Vec<&str> = rest.iter().map(|(l, _)| l.key.as_str()).collect();
        assert_eq!(keys, ["a.txt:3", "b.txt:1", "b.txt:2"]);
        // After the last line of an object: the next one.
        let rest = read_all(&src, &splits[0], Some(all[2].1)).await;
        assert_eq!(rest[0].0.key, "b.txt:1");
    }

    #[tokio::test]
    async fn gzip_and_zstd_objects_are_read_by_extension_and_resumed_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let text: String = (1..=100).map(|i| format!("line {i}\n")).collect();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(text.as_bytes()).unwrap();
        std::fs::write(dir.path().join("a.txt.gz"), gz.finish().unwrap()).unwrap();
        std::fs::write(dir.path().join("b.txt.zst"), zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let split = src.plan_splits().await.unwrap().remove(0);
        let all = read_all(&src, &split, None).await;
        assert_eq!(all.len(), 200);
        assert_eq!((all[0].0.key.as_str(), all[0].0.content.as_str()), ("a.txt.gz:1", "line 1"));
        assert_eq!((all[199].0.key.as_str(), all[199].0.content.as_str()), ("b.txt.zst:100", "line 100"));
        // Resuming mid-object skips the lines already done.
        let rest = read_all(&src, &split, Some(all[149].1)).await;
        assert_eq!(rest.len(), 50);
        assert_eq!(rest[0].0.key, "b.txt.zst:51");
    }

    #[tokio::test]
    async fn empty_objects_compressed_or_not_have_no_lines() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["a.txt", "b.txt.gz", "c.txt.zst"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        std::fs::write(dir.path().join("d.txt"), "last\n").unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let split = src.plan_splits().await.unwrap().remove(0);
        let all = read_all(&src, &split, None).await;
        let keys: Vec<&str> = all.iter().map(|(l, _)| l.key.as_str()).collect();
        assert_eq!(keys, ["d.txt:1"]);
    }

    /// What reading the only split of `dir` ends with.
    async fn read_error(dir: &std::path::Path) -> SourceError {
        let src = FilesSource::open(dir.to_str().unwrap(), 1 << 20).unwrap();
        let split = src.plan_splits().await.unwrap().remove(0);
        let lane = LaneInfo::new(split.id, Epoch(1), InstanceId::new("t").unwrap(), split.descriptor, 1);
        let mut r = src.open(&lane, None).await.unwrap();
        loop {
            match r.next().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("read to the end without an error"),
                Err(e) => return e,
            }
        }
    }

    #[tokio::test]
    async fn a_line_that_is_not_utf8_is_a_bad_record_never_replaced_and_reading_goes_on_after_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), b"fine\ncaf\xe9\nafter\n").unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap();
        let split = src.plan_splits().await.unwrap().remove(0);
        let lane = LaneInfo::new(split.id, Epoch(1), InstanceId::new("t").unwrap(), split.descriptor, 1);
        let mut r = src.open(&lane, None).await.unwrap();
        assert_eq!(r.next().await.unwrap().unwrap().0.content, "fine");
        let Err(SourceError::BadRecord(bad)) = r.next().await else { panic!("a bad record") };
        assert_eq!((bad.position.as_str(), bad.raw.as_ref()), ("a.txt:2", &b"caf\xe9"[..]));
        assert!(bad.error.contains("not UTF-8"), "{}", bad.error);
        // The reader is past it: the next line, with progress counting the bad one.
        let (line, progress) = r.next().await.unwrap().unwrap();
        assert_eq!((line.key.as_str(), line.content.as_str(), progress.line), ("a.txt:3", "after", 3));
    }

    #[tokio::test]
    async fn an_object_that_is_not_what_its_extension_says_is_unprocessable() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt.gz"), "plain text, not gzip\n").unwrap();
        let e = read_error(dir.path()).await;
        assert!(matches!(e, SourceError::Unprocessable(_)), "{e:?}");
        assert!(e.to_string().contains("decoding a.txt.gz"), "{e}");
    }

    #[tokio::test]
    async fn follow_mode_plans_one_split_per_object_with_stable_ids() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "1\n").unwrap();
        let src = FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap().follow();
        let first = src.plan().await.unwrap();
        assert_eq!(first.kind, PlanKind::Open);
        std::fs::write(dir.path().join("b.txt"), "2\n").unwrap();
        let second = src.plan().await.unwrap();
        assert_eq!(second.splits.len(), 2);
        assert_eq!(second.splits[0].id, first.splits[0].id, "an object keeps its split");
        assert_ne!(
            src.fingerprint(),
            FilesSource::open(dir.path().to_str().unwrap(), 1 << 20).unwrap().fingerprint()
        );
    }

    #[test]
    fn a_missing_directory_is_a_clear_error() {
        let err = FilesSource::open("/definitely/not/here", 10).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        assert!(matches!(FilesSource::open("/tmp", 0), Err(FilesError::ZeroSplitBytes)));
    }
}
