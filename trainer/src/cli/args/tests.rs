use super::*;
use crate::cli::{Cli, Cmd};
use clap::Parser;
use clap::error::ErrorKind;

#[derive(clap::Parser)]
struct Fit {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    fit: FitArgs,
}

fn fit(flags: &[&str]) -> Fit {
    let argv = ["fit", "--data", "t.parquet"]
        .into_iter()
        .chain(flags.iter().copied());
    Fit::try_parse_from(argv).unwrap()
}

fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("trainer").chain(args.iter().copied()))
}

fn refused(args: &[&str]) -> ErrorKind {
    parse(args).err().expect("refused").kind()
}

/// `base` followed by `more`.
fn cmd<'a>(base: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
    [base, more].concat()
}

#[test]
fn data_version_and_timestamp_conflict_and_a_timestamp_must_be_a_time() {
    let fit_cmd = ["fit", "--data", "t", "--out", "r"];
    let both = cmd(
        &fit_cmd,
        &["--data-version", "3", "--data-timestamp", "2026-12-01"],
    );
    assert_eq!(refused(&both), ErrorKind::ArgumentConflict);
    let not_a_time = cmd(&fit_cmd, &["--data-timestamp", "yesterday"]);
    assert_eq!(refused(&not_a_time), ErrorKind::ValueValidation);
    // A valid time is kept as written; the other columns keep their defaults.
    let t = fit(&[
        "--data-timestamp",
        "2026-12-01 06:00:00",
        "--label-column",
        "class",
        "--skip-unlabelled",
    ]);
    let s = t.data.source();
    assert_eq!(
        (
            s.label_column.as_str(),
            s.content_column.as_str(),
            s.path_column.as_str()
        ),
        ("class", "content", "path")
    );
    assert_eq!(
        (
            s.data_version,
            s.data_timestamp.as_deref(),
            s.skip_unlabelled
        ),
        (None, Some("2026-12-01 06:00:00"), true)
    );
}

#[test]
fn fine_tune_trains_blocks_with_adamw_and_stops_early_after_three_epochs() {
    let t = fit(&["--fine-tune", "2"]);
    let p = t.fit.params(&t.data, EngineKind::Tract, 1).unwrap();
    assert_eq!(
        (p.unfreeze_last, p.optimizer, p.early_stopping, p.head_first),
        (2, Optimizer::Adamw, Some(3), true)
    );
    assert_eq!(p.lr, Optimizer::Adamw.default_lr());
    let t = fit(&[
        "--optimizer",
        "sgd",
        "--augment",
        "crop",
        "--early-stopping",
        "5",
    ]);
    let p = t.fit.params(&t.data, EngineKind::Tract, 4).unwrap();
    assert_eq!(
        (p.optimizer, p.lr, p.epochs, p.unfreeze_last, p.head_first),
        (Optimizer::Sgd, 0.01, 10, 0, false)
    );
    assert_eq!(
        (p.augment_flip, p.augment_crop, p.early_stopping, p.workers),
        (false, true, Some(5), 4)
    );
    assert_eq!((p.data, p.more_data), (PathBuf::from("t.parquet"), vec![]));
    let both = [
        "fit",
        "--data",
        "t",
        "--out",
        "r",
        "--fine-tune",
        "1",
        "--unfreeze-last",
        "1",
    ];
    assert_eq!(refused(&both), ErrorKind::ArgumentConflict);
}

#[test]
fn epoch_flags_given_to_an_lbfgs_head_are_named_in_a_warning() {
    let t = fit(&["--epochs", "5", "--lr", "0.1", "--schedule", "cosine"]);
    let p = t.fit.params(&t.data, EngineKind::Tract, 1).unwrap();
    assert_eq!(
        p.optimizer,
        Optimizer::Lbfgs,
        "a head alone is solved by lbfgs"
    );
    let w = t.fit.unused_epoch_flags(&p).expect("a warning");
    assert!(
        w.starts_with("--epochs, --lr, --schedule train sgd or adamw;"),
        "{w}"
    );
    // Used by the optimizer asked for, or by --fine-tune's second stage: no warning.
    for flags in [
        &["--epochs", "5", "--optimizer", "adamw"][..],
        &["--epochs", "5", "--fine-tune", "1", "--optimizer", "lbfgs"][..],
    ] {
        let t = fit(flags);
        let p = t.fit.params(&t.data, EngineKind::Tract, 1).unwrap();
        assert_eq!(t.fit.unused_epoch_flags(&p), None, "{flags:?}");
    }
}

#[test]
fn export_and_label_refuse_flag_combinations_they_do_not_allow() {
    let export = ["export", "--run", "r", "--out", "o"];
    let alias_alone = cmd(&export, &["--alias", "staging"]);
    assert_eq!(refused(&alias_alone), ErrorKind::MissingRequiredArgument);
    assert_eq!(
        refused(&cmd(&export, &["--quantize", "int4"])),
        ErrorKind::InvalidValue
    );
    assert_eq!(
        refused(&cmd(&export, &["--dtype", "f64"])),
        ErrorKind::InvalidValue
    );
    let ok = parse(&cmd(
        &export,
        &[
            "--quantize",
            "int8-weights",
            "--register",
            "cams",
            "--alias",
            "staging",
        ],
    ));
    assert!(matches!(ok.map(|c| c.cmd), Ok(Cmd::Export(_))));
    // label: exactly one of --from and --export.
    assert_eq!(
        refused(&["label", "--table", "t"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(
        refused(&[
            "label", "--table", "t", "--from", "a.csv", "--export", "b.csv"
        ]),
        ErrorKind::ArgumentConflict
    );
    assert!(matches!(
        parse(&["label", "--table", "t", "--export", "b.csv"]).map(|c| c.cmd),
        Ok(Cmd::Label(_))
    ));
}
