use super::*;

#[test]
fn stratified_folds_put_one_sample_of_each_class_in_every_fold() {
    // Four training samples of classes 0 and 1 (sample 8, of class 2, is not in training).
    let labels = [0, 1, 0, 1, 0, 1, 0, 1, 2];
    let train: Vec<usize> = (0..8).collect();
    let folds = stratified_folds(&labels, &train, 3, 7);
    assert_eq!(folds.len(), 4, "{folds:?}");
    for f in &folds {
        let mut classes: Vec<usize> = f.iter().map(|&i| labels[i]).collect();
        classes.sort_unstable();
        assert_eq!(classes, [0, 1], "{folds:?}");
    }
    let mut all = folds.concat();
    all.sort_unstable();
    assert_eq!(all, train);
    // A class with a single training sample: too few to cross-validate.
    assert!(stratified_folds(&[0, 0, 1], &[0, 1, 2], 2, 7).is_empty());
}

#[test]
fn standardizer_floors_a_dead_feature_at_the_median_std() {
    // Features: 1, 3, 5 (std sqrt(8/3)); constant 10 (std 0); 0, 0, 6 (std sqrt(8)).
    let data = [1.0f32, 10.0, 0.0, 3.0, 10.0, 0.0, 5.0, 10.0, 6.0];
    let f = FeatureRows {
        data: &data,
        dim: 3,
        labels: &[0, 0, 0],
    };
    let st = Standardizer::fit(f, &[0, 1, 2]);
    assert_eq!(st.mean, [3.0, 10.0, 2.0]);
    let want = [
        (3.0f64 / 8.0).sqrt(),
        (3.0f64 / 8.0).sqrt(),
        (1.0f64 / 8.0).sqrt(),
    ];
    for (a, e) in st.inv_std.iter().zip(want) {
        assert!((*a as f64 - e).abs() < 1e-6, "{:?}", st.inv_std);
    }
}

#[test]
fn temperature_is_ln_4_for_four_right_of_five_and_never_below_1() {
    let comms = crate::distributed::local_group(1, std::time::Duration::from_secs(5));
    let t = |v: &[f32], n: usize| CTensor::from_vec(v.to_vec(), (n, 2), &Device::Cpu).unwrap();
    // Margin-1 logits for class 0 on every row; four rows are class 0, one is class 1:
    // the loss is flat where sigmoid(T) = 4/5.
    let z = t(&[1.0f32, 0.0].repeat(5), 5);
    let y = t(&[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0], 5);
    let (temp, _) = fit_temperature(&[(z, y)], &comms[0]).unwrap();
    assert!((temp - 4f64.ln()).abs() < 1e-5, "{temp}");
    // One right, one wrong: the best T is 0, floored at 1, where the loss is ln(2 + e + 1/e).
    let z = t(&[1.0, 0.0, 1.0, 0.0], 2);
    let y = t(&[1.0, 0.0, 0.0, 1.0], 2);
    let (temp, loss) = fit_temperature(&[(z, y)], &comms[0]).unwrap();
    assert_eq!(temp, 1.0);
    let e = std::f64::consts::E;
    assert!((loss - (2.0 + e + 1.0 / e).ln()).abs() < 1e-9, "{loss}");
}
