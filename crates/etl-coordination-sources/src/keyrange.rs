//! Balanced ranges of an integer key: the planner the database sources share.
//!
//! Ranges are balanced by **rows**, exactly: walking the key's index in order, a range ends
//! where `split_rows` rows have been counted (the next range starts at the key of the row at
//! that offset), so ids with large gaps or dense clusters still give ranges of `split_rows`
//! rows each (the last one takes the rest). Planning reads the key's index once, a query per
//! range each stepping `split_rows` entries on from the last boundary, never from the start.
//!
//! A split's id carries its range (`r-NAME-LO-HI`), so a follow round can start where the
//! published ranges end ([`next_start`]) without reading their descriptors.

use std::future::Future;

use bytes::Bytes;
use etl_coordination_driver::{PlannedSplit, SplitId};
use serde::{Deserialize, Serialize};

/// A split's descriptor: the key range `[lo, hi)`; `[i64::MAX, i64::MAX]` is the range of the
/// one key `i64::MAX` (which no end-exclusive range can hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    /// First key (inclusive).
    pub lo: i64,
    /// End (exclusive).
    pub hi: i64,
}

impl IdRange {
    /// The last key the range holds (what a query's `key <= ?` bound is).
    pub fn last_key(&self) -> i64 {
        if self.lo == i64::MAX { i64::MAX } else { self.hi - 1 }
    }

    /// An estimate of the rows of a range of `rows` rows up to and including the key `last`:
    /// the key's place in the range, as if its keys were spread evenly (what
    /// [`SplitReader::position`](etl_coordination_driver::SplitReader::position) reports for
    /// a key range; exact for dense keys).
    pub fn position(&self, rows: u64, last: i64) -> u64 {
        let span = (i128::from(self.last_key()) - i128::from(self.lo) + 1).max(1);
        let done = (i128::from(last) - i128::from(self.lo) + 1).clamp(0, span);
        u64::try_from(i128::from(rows) * done / span).unwrap_or(rows)
    }

    /// Whether `key` is in the range.
    pub fn contains(&self, key: i64) -> bool {
        key >= self.lo && key <= self.last_key()
    }

    /// The first key a reader still has to read after `progress` (the last key it emitted):
    /// a query's `key >= ?` bound. `None` when nothing can be left (the progress is the largest
    /// key). No `key > last` condition is needed, so the key `i64::MIN` is read like any other.
    pub fn resume_at(&self, progress: Option<i64>) -> Option<i64> {
        match progress {
            None => Some(self.lo),
            Some(last) => last.checked_add(1).map(|next| next.max(self.lo)),
        }
    }
}

/// What the range planner asks of a table: its keys in order. Implementations run every call
/// of one planning round in one read-only snapshot, so the ranges agree with each other. Keys
/// must be unique and never NULL (a NULL key is in no range).
pub trait KeyIndex {
    /// The table cannot be read.
    type Error;

    /// Among the rows with a key in `lo..=upto`, in key order, the key of the row `offset`
    /// rows past the first (`ORDER BY key OFFSET offset LIMIT 1`); `None` when there are not
    /// that many.
    fn key_at(
        &mut self,
        lo: i64,
        upto: i64,
        offset: u64,
    ) -> impl Future<Output = Result<Option<i64>, Self::Error>> + Send;

    /// How many rows have a key in `lo..=upto`, and the largest of them.
    fn tail(
        &mut self,
        lo: i64,
        upto: i64,
    ) -> impl Future<Output = Result<(u64, Option<i64>), Self::Error>> + Send;

    /// The error for a key that repeats (`key_at` did not move past it): the key is not unique.
    fn repeated(key: i64) -> Self::Error;
}

/// The ranges of `split_rows` rows each over the rows with a key in `from..=upto`, as splits
/// of `name` (their weight is their row count).
pub async fn plan_ranges<I: KeyIndex>(
    index: &mut I,
    name: &str,
    from: i64,
    upto: i64,
    split_rows: u64,
) -> Result<Vec<PlannedSplit>, I::Error> {
    if upto < from {
        return Ok(Vec::new());
    }
    // Beyond i64::MAX rows an offset means nothing (and SQL takes a signed one).
    let split_rows = split_rows.clamp(1, i64::MAX as u64);
    let mut bounds = vec![from];
    while let Some(next) = index.key_at(*bounds.last().expect("never empty"), upto, split_rows).await? {
        let last = *bounds.last().expect("never empty");
        if next <= last {
            // More than `split_rows` rows share one key: planning would never move on.
            return Err(I::repeated(next));
        }
        bounds.push(next);
    }
    let last = *bounds.last().expect("never empty");
    let (rest, max) = index.tail(last, upto).await?;
    let Some(max) = max.filter(|_| rest > 0) else {
        // No row at or past `last`: only possible when there is no row at all past `from`.
        return Ok(Vec::new());
    };
    let mut ranges: Vec<(IdRange, u64)> =
        bounds.windows(2).map(|w| (IdRange { lo: w[0], hi: w[1] }, split_rows)).collect();
    if max < i64::MAX {
        ranges.push((IdRange { lo: last, hi: max + 1 }, rest));
    } else {
        // The key i64::MAX has a range of its own, after the rest of the last range.
        if last < i64::MAX && rest > 1 {
            ranges.push((IdRange { lo: last, hi: i64::MAX }, rest - 1));
        }
        ranges.push((IdRange { lo: i64::MAX, hi: i64::MAX }, 1));
    }
    Ok(ranges
        .into_iter()
        .map(|(range, rows)| {
            PlannedSplit::new(
                range_id(name, range),
                Bytes::from(serde_json::to_vec(&range).expect("serializable")),
                rows,
            )
        })
        .collect())
}

/// Where a follow round starts: the end of the published ranges of `name` (`i64::MIN` when
/// there are none); `None` when they reach the largest key (nothing can come after).
pub fn next_start(name: &str, published: &[SplitId]) -> Option<i64> {
    match published.iter().filter_map(|id| range_end(name, id)).max() {
        None => Some(i64::MIN),
        Some(i64::MAX) => None,
        Some(end) => Some(end),
    }
}

/// A range's split id: `r-NAME-LO-HI`, a negative bound written with `m` for its minus sign
/// (`-5` is `m5`, so `-` only separates; `i64::MIN` is `min`).
pub fn range_id(name: &str, r: IdRange) -> SplitId {
    let name = id_name(name);
    let n = |v: i64| match v {
        i64::MIN => "min".to_owned(),
        v if v < 0 => format!("m{}", v.unsigned_abs()),
        v => v.to_string(),
    };
    SplitId::new(format!("r-{name}-{}-{}", n(r.lo), n(r.hi))).expect("valid id")
}

/// The end of the range a split id of `name` names.
fn range_end(name: &str, id: &SplitId) -> Option<i64> {
    let name = id_name(name);
    let hi = id.as_str().strip_prefix(&format!("r-{name}-"))?.rsplit_once('-')?.1;
    match hi.strip_prefix('m') {
        Some("in") => Some(i64::MIN),
        Some(abs) => abs.parse::<i64>().ok().map(|v| -v),
        None => hi.parse().ok(),
    }
}

/// A name as split ids carry it: its first 60 characters (an id is at most 128; the bounds take
/// up to 43 more).
fn id_name(name: &str) -> &str {
    name.char_indices().nth(60).map_or(name, |(i, _)| &name[..i])
}

/// Runs a future that never waits (a [`KeyIndex`] over a blocking client, called on a blocking
/// thread) to its end.
#[cfg(any(feature = "sqlite", test))]
pub(crate) fn run_ready<F: Future>(f: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(f).poll(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => unreachable!("a blocking KeyIndex never waits"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_key_s_position_is_its_place_in_the_range() {
        let r = IdRange { lo: 100, hi: 200 };
        assert_eq!(r.position(50, 99), 0, "before the range");
        assert_eq!(r.position(50, 149), 25);
        assert_eq!(r.position(50, 199), 50, "the last key");
        assert_eq!(r.position(50, i64::MAX), 50, "never past the rows");
        let max = IdRange { lo: i64::MAX, hi: i64::MAX };
        assert_eq!(max.position(1, i64::MAX), 1);
        let all = IdRange { lo: i64::MIN, hi: i64::MAX };
        assert_eq!(all.position(1000, 0), 500);
    }

    /// A table's keys in memory, counting the index entries each query steps over.
    struct Keys {
        keys: Vec<i64>,
        stepped: u64,
    }

    impl KeyIndex for Keys {
        type Error = String;

        async fn key_at(&mut self, lo: i64, upto: i64, offset: u64) -> Result<Option<i64>, Self::Error> {
            let start = self.keys.partition_point(|k| *k < lo);
            self.stepped += offset + 1;
            Ok(self.keys.get(start + offset as usize).copied().filter(|k| *k <= upto))
        }

        async fn tail(&mut self, lo: i64, upto: i64) -> Result<(u64, Option<i64>), Self::Error> {
            let start = self.keys.partition_point(|k| *k < lo);
            let end = self.keys.partition_point(|k| *k <= upto);
            let n = end.saturating_sub(start);
            self.stepped += n as u64;
            Ok((n as u64, self.keys[..end].last().copied().filter(|_| n > 0)))
        }

        fn repeated(key: i64) -> String {
            format!("repeated {key}")
        }
    }

    fn plan(keys: &BTreeSet<i64>, from: i64, rows: u64) -> (Vec<PlannedSplit>, u64) {
        plan_upto(keys, from, i64::MAX, rows)
    }

    fn plan_upto(keys: &BTreeSet<i64>, from: i64, upto: i64, rows: u64) -> (Vec<PlannedSplit>, u64) {
        let mut index = Keys { keys: keys.iter().copied().collect(), stepped: 0 };
        let splits = run_ready(plan_ranges(&mut index, "t", from, upto, rows)).unwrap();
        (splits, index.stepped)
    }

    proptest! {
        /// Whatever the key distribution, every key at least `from` is in exactly one range,
        /// every range but the last holds `split_rows` keys, weights are row counts, and
        /// planning steps over each index entry about once.
        #[test]
        fn ranges_hold_split_rows_keys_each_and_cover_every_key_once(
            keys in proptest::collection::btree_set(prop_oneof![
                any::<i64>(),
                -50i64..50,
                (i64::MAX - 5)..=i64::MAX,
                i64::MIN..(i64::MIN + 5),
            ], 0..300),
            from in prop_oneof![Just(i64::MIN), -20i64..20],
            upto in prop_oneof![Just(i64::MAX), -20i64..20],
            rows in 1u64..40,
        ) {
            let (splits, stepped) = plan_upto(&keys, from, upto, rows);
            let wanted: Vec<i64> = keys.iter().copied().filter(|k| *k >= from && *k <= upto).collect();
            let ranges: Vec<IdRange> =
                splits.iter().map(|s| serde_json::from_slice(&s.descriptor).unwrap()).collect();
            for k in &wanted {
                prop_assert_eq!(ranges.iter().filter(|r| r.contains(*k)).count(), 1, "key {}", k);
            }
            for (i, (r, s)) in ranges.iter().zip(&splits).enumerate() {
                let held = wanted.iter().filter(|k| r.contains(**k)).count() as u64;
                prop_assert_eq!(held, s.weight);
                prop_assert!(held >= 1 && held <= rows);
                // Only the last range (or the one before the range of i64::MAX) is short.
                if i + 2 < ranges.len() || (i + 1 < ranges.len() && ranges[i + 1].lo != i64::MAX) {
                    prop_assert_eq!(held, rows);
                }
                prop_assert_eq!(range_end("t", &s.id), Some(r.hi));
            }
            // A walk from the start at every boundary would step O(keys² / rows).
            prop_assert!(stepped <= wanted.len() as u64 + ranges.len() as u64 + 2 * rows + 2, "{stepped} steps");
        }
    }

    #[test]
    fn a_reader_resumes_at_the_key_after_its_progress_and_reads_i64_min() {
        let r = IdRange { lo: i64::MIN, hi: 10 };
        assert_eq!(r.resume_at(None), Some(i64::MIN), "the key i64::MIN is read");
        assert_eq!(r.resume_at(Some(i64::MIN)), Some(i64::MIN + 1));
        assert_eq!(IdRange { lo: 5, hi: 10 }.resume_at(Some(-3)), Some(5));
        let top = IdRange { lo: i64::MAX, hi: i64::MAX };
        assert_eq!(top.resume_at(None), Some(i64::MAX));
        assert_eq!(top.resume_at(Some(i64::MAX)), None, "nothing after the largest key");
    }

    #[test]
    fn a_repeated_key_is_an_error_not_an_endless_plan() {
        struct Same;
        impl KeyIndex for Same {
            type Error = String;
            async fn key_at(&mut self, _: i64, _: i64, _: u64) -> Result<Option<i64>, String> {
                Ok(Some(7))
            }
            async fn tail(&mut self, _: i64, _: i64) -> Result<(u64, Option<i64>), String> {
                Ok((0, None))
            }
            fn repeated(key: i64) -> String {
                format!("repeated {key}")
            }
        }
        assert_eq!(run_ready(plan_ranges(&mut Same, "t", 7, i64::MAX, 10)).unwrap_err(), "repeated 7");
    }

    #[test]
    fn a_long_name_is_cut_in_ids_and_still_gives_the_end_back() {
        let name = "t".repeat(200);
        let id = range_id(&name, IdRange { lo: i64::MIN, hi: i64::MIN + 1 });
        assert!(id.as_str().len() <= 128);
        assert_eq!(range_end(&name, &id), Some(i64::MIN + 1));
    }

    #[test]
    fn skewed_keys_give_ranges_of_equal_rows() {
        // A dense cluster, a gap of a billion, a sparse run.
        let keys: BTreeSet<i64> = (0..5_000)
            .chain(1_000_000_000..1_000_002_500)
            .chain((0..2_500).map(|k| 2_000_000_000 + k * 997))
            .collect();
        let (splits, _) = plan(&keys, i64::MIN, 1_000);
        assert_eq!(splits.len(), 10);
        assert!(splits.iter().all(|s| s.weight == 1_000));
    }

    #[test]
    fn a_follow_round_starts_where_the_published_ranges_end() {
        let keys: BTreeSet<i64> = (-10..10).collect();
        let (first, _) = plan(&keys, i64::MIN, 8);
        let ids: Vec<SplitId> = first.iter().map(|s| s.id.clone()).collect();
        assert_eq!(next_start("t", &ids), Some(10));
        assert_eq!(next_start("t", &[]), Some(i64::MIN));
        assert_eq!(next_start("other", &ids), Some(i64::MIN), "another table's ranges are not ours");
        let top: BTreeSet<i64> = [i64::MAX].into();
        let (last, _) = plan(&top, i64::MIN, 8);
        let ids: Vec<SplitId> = last.iter().map(|s| s.id.clone()).collect();
        assert_eq!(next_start("t", &ids), None, "nothing comes after the largest key");
    }

    #[test]
    fn a_split_id_gives_back_the_end_of_its_range_whatever_its_sign() {
        for (lo, hi) in
            [(i64::MIN, -5), (-9, -1), (-3, 4), (0, 7), (i64::MIN, i64::MAX), (i64::MIN, i64::MIN)]
        {
            let id = range_id("orders", IdRange { lo, hi });
            assert_eq!(range_end("orders", &id), Some(hi), "{id}");
        }
    }
}
