//! Seeded stratified splits and the per-epoch batch plan shared by every worker count.

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
    Test,
}

/// Assigns each sample to train/val/test, per class: `round(n * fraction)` samples of each class go
/// to validation and test (at least one sample of every class stays in train). Seeded.
pub fn stratified(
    labels: &[usize],
    classes: usize,
    val_fraction: f64,
    test_fraction: f64,
    seed: u64,
) -> Vec<Split> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = vec![Split::Train; labels.len()];
    for c in 0..classes {
        let mut idx: Vec<usize> = (0..labels.len()).filter(|&i| labels[i] == c).collect();
        idx.shuffle(&mut rng);
        let n = idx.len();
        let n_val = ((n as f64 * val_fraction).round() as usize).min(n.saturating_sub(1));
        let n_test = ((n as f64 * test_fraction).round() as usize).min(n.saturating_sub(1 + n_val));
        for &i in &idx[..n_val] {
            out[i] = Split::Val;
        }
        for &i in &idx[n_val..n_val + n_test] {
            out[i] = Split::Test;
        }
    }
    out
}

/// Per-class counts per split, as a table.
pub fn count_table(labels: &[usize], splits: &[Split], names: &[String]) -> String {
    let mut s = format!("{:<16}{:>8}{:>8}{:>8}\n", "class", "train", "val", "test");
    let mut totals = [0usize; 3];
    for (c, name) in names.iter().enumerate() {
        let mut n = [0usize; 3];
        for (l, sp) in labels.iter().zip(splits) {
            if *l == c {
                n[*sp as usize] += 1;
            }
        }
        for k in 0..3 {
            totals[k] += n[k];
        }
        s += &format!(
            "{:<16}{:>8}{:>8}{:>8}\n",
            truncate(name, 15),
            n[0],
            n[1],
            n[2]
        );
    }
    s += &format!(
        "{:<16}{:>8}{:>8}{:>8}\n",
        "total", totals[0], totals[1], totals[2]
    );
    s
}

fn truncate(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// The global batches of one epoch: `indices` shuffled with a generator seeded from (seed, epoch),
/// cut into batches of exactly `batch`; the last batch wraps around to the start of the shuffled
/// order. Every worker count derives its local batches from this same plan ([`local_part`]), so
/// N workers with global batch B compute the same updates as one worker with batch B.
pub fn epoch_batches(indices: &[usize], batch: usize, seed: u64, epoch: usize) -> Vec<Vec<usize>> {
    assert!(!indices.is_empty() && batch > 0);
    let mut order = indices.to_vec();
    let mut rng =
        StdRng::seed_from_u64(seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    let steps = order.len().div_ceil(batch);
    (0..steps)
        .map(|s| {
            (0..batch)
                .map(|k| order[(s * batch + k) % order.len()])
                .collect()
        })
        .collect()
}

/// Rank `rank`'s contiguous share of a global batch: `[r*B/W, (r+1)*B/W)`. When `B` is not a
/// multiple of `W` the parts differ by one sample; training weights each rank's mean-loss gradient
/// by `part / B`, so the summed gradient is still exactly the global batch's mean-loss gradient.
pub fn local_part(batch: &[usize], rank: usize, world: usize) -> &[usize] {
    &batch[crate::distributed::share(batch.len(), rank, world)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stratified_is_seeded_and_per_class() {
        let labels: Vec<usize> = (0..100).map(|i| usize::from(i >= 80)).collect();
        let a = stratified(&labels, 2, 0.2, 0.1, 42);
        assert_eq!(a, stratified(&labels, 2, 0.2, 0.1, 42));
        assert_ne!(a, stratified(&labels, 2, 0.2, 0.1, 43));
        let count = |c: usize, s: Split| {
            labels
                .iter()
                .zip(&a)
                .filter(|(l, x)| **l == c && **x == s)
                .count()
        };
        assert_eq!(
            (
                count(0, Split::Val),
                count(0, Split::Test),
                count(0, Split::Train)
            ),
            (16, 8, 56)
        );
        assert_eq!(
            (
                count(1, Split::Val),
                count(1, Split::Test),
                count(1, Split::Train)
            ),
            (4, 2, 14)
        );
        let t = count_table(&labels, &a, &["a".into(), "b".into()]);
        assert!(
            t.contains("a                     56      16       8"),
            "{t}"
        );
    }

    #[test]
    fn batches_are_full_and_cover_everything() {
        let idx: Vec<usize> = (0..10).collect();
        let b = epoch_batches(&idx, 4, 1, 0);
        assert_eq!(b.len(), 3);
        assert!(b.iter().all(|x| x.len() == 4));
        let mut seen: Vec<usize> = b.concat()[..10].to_vec();
        seen.sort();
        assert_eq!(seen, idx);
        assert_ne!(b, epoch_batches(&idx, 4, 1, 1));
        assert_eq!(local_part(&b[0], 1, 2), &b[0][2..4]);
        assert_eq!(local_part(&b[0], 0, 3), &b[0][0..1]);
        assert_eq!(local_part(&b[0], 2, 3), &b[0][2..4]);
    }

    #[test]
    fn every_class_keeps_a_training_sample_whatever_the_fractions() {
        // Class 0: one sample; class 1: four; class 2: three; class 3: none at all.
        let labels = [0, 1, 1, 1, 1, 2, 2, 2];
        let splits = stratified(&labels, 4, 0.5, 0.5, 7);
        assert_eq!(splits.len(), labels.len());
        let counts = |c: usize| {
            let n = |s: Split| {
                labels
                    .iter()
                    .zip(&splits)
                    .filter(|(l, x)| **l == c && **x == s)
                    .count()
            };
            (n(Split::Train), n(Split::Val), n(Split::Test))
        };
        // round(n * 0.5), half away from zero, each capped so that one sample stays in train.
        assert_eq!(counts(0), (1, 0, 0));
        assert_eq!(counts(1), (1, 2, 1));
        assert_eq!(counts(2), (1, 2, 0));
    }

    #[test]
    fn count_table_truncates_class_names_to_fifteen_characters_and_totals_each_split() {
        let labels = [0, 0, 0, 1];
        let splits = [Split::Train, Split::Val, Split::Test, Split::Train];
        let names = ["a_very_long_class_name".to_string(), "b".to_string()];
        assert_eq!(
            count_table(&labels, &splits, &names),
            "class              train     val    test\n\
             a_very_long_cla        1       1       1\n\
             b                      1       0       0\n\
             total                  2       1       1\n"
        );
    }

    #[test]
    fn the_last_batch_wraps_around_to_the_start_of_the_shuffled_order() {
        let idx: Vec<usize> = (10..15).collect();
        let b = epoch_batches(&idx, 2, 9, 3);
        assert_eq!(b.len(), 3);
        assert_eq!(
            b[2][1], b[0][0],
            "5 samples in batches of 2: the sixth slot is the first again"
        );
        let mut order = b.concat()[..5].to_vec();
        order.sort();
        assert_eq!(order, idx);
        // A batch larger than the split repeats the shuffled order within the one batch.
        let small = [4usize, 5, 6];
        let one = epoch_batches(&small, 8, 9, 0);
        assert_eq!((one.len(), one[0].len()), (1, 8));
        assert!((0..8).all(|k| one[0][k] == one[0][k % 3]), "{one:?}");
        let mut first = one[0][..3].to_vec();
        first.sort();
        assert_eq!(first, small);
    }
}
