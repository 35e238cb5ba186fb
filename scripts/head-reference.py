#!/usr/bin/env python3
"""The head's optimum on a run's own split and features, by scikit-learn (the tests' reference).

usage: head-reference.py FEATURES_DIR RUN_DIR...

FEATURES_DIR is a feature cache of pooled features (`trainer prepare --json` prints it as
`features_cache`: meta.json + features.f32, one row per sample in the order of the runs'
split.json). For every RUN_DIR (trained on that cache) it standardizes the features with the
training split's statistics, fits L2 logistic regression (multinomial, lbfgs, solved to
convergence) with C chosen by 5-fold stratified cross-validation on the training split only
(LogisticRegressionCV), and prints one JSON line: {"run", "val_accuracy", "C"}.
"""
import json
import os
import sys
import warnings

import numpy as np
from sklearn.linear_model import LogisticRegressionCV
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import StandardScaler


def main():
    warnings.simplefilter("ignore", FutureWarning)
    feat_dir, runs = sys.argv[1], sys.argv[2:]
    meta = json.load(open(os.path.join(feat_dir, "meta.json")))
    dim = int(np.prod(meta["dims"]))
    x = np.fromfile(os.path.join(feat_dir, "features.f32"), dtype="<f4").reshape(-1, dim)
    for run in runs:
        split = json.load(open(os.path.join(run, "split.json")))
        if len(split) != len(x):
            sys.exit(f"{run}: {len(split)} samples in split.json, {len(x)} feature rows")
        labels = np.array([s["label"] for s in split])
        train = np.array([s["split"] == "train" for s in split])
        val = np.array([s["split"] == "val" for s in split])
        scaler = StandardScaler().fit(x[train])
        clf = LogisticRegressionCV(
            Cs=np.logspace(-4, 2, 13),
            cv=StratifiedKFold(5, shuffle=True, random_state=0),
            max_iter=5000,
            n_jobs=2,
        ).fit(scaler.transform(x[train]), labels[train])
        acc = float((clf.predict(scaler.transform(x[val])) == labels[val]).mean())
        print(json.dumps({"run": run, "val_accuracy": acc, "C": float(clf.C_[0])}), flush=True)


if __name__ == "__main__":
    main()
