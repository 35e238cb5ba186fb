//! `trainer export` tracked: the export joins the run's MLflow run (a new one when the run was not
//! tracked), optionally reserves a registered version first (the artifact then carries its
//! version and `models:/` URI), logs the artifact as the run's MLflow Model and sets the alias
//! after the files, so an alias never points at a version without them.

use std::path::{Path, PathBuf};

use kestrel_shared::manifest::Manifest;

use super::registry::version_uri;
use super::{Metric, ModelVersion, Op, TrackError, TrackTo, Tracker, kv};
use crate::distributed::Job;
use crate::export::{self, ExportError, ExportOpts};

#[derive(Debug, thiserror::Error)]
pub enum TrackedExportError {
    #[error(transparent)]
    Track(#[from] TrackError),
    #[error("registering {name} in MLflow")]
    Register {
        name: String,
        #[source]
        source: TrackError,
    },
    #[error("exporting {} to {}", run.display(), out.display())]
    Export {
        run: PathBuf,
        out: PathBuf,
        #[source]
        source: ExportError,
    },
}

/// What to register and how to name it.
#[derive(Debug, Clone, Default)]
pub struct Registration<'a> {
    /// The registered model to add a version to.
    pub name: Option<&'a str>,
    /// The alias the new version gets once its files are logged.
    pub alias: Option<&'a str>,
}

/// An exported artifact and its tracking.
pub struct TrackedExport {
    pub manifest: Manifest,
    pub registered: Option<ModelVersion>,
    /// What is left to `trainer mlflow sync`, if anything.
    pub pending: Option<String>,
}

/// [`export::export`] of `run` to `out`, tracked when `to` says where. `opts.version` is the
/// registered version's when `register.name` is given and `model_version` is not (else
/// `model_version`, else 1). A failed export takes the reserved version back.
pub fn tracked_export(
    run: &Path,
    out: &Path,
    mut opts: ExportOpts,
    model_version: Option<u64>,
    job: &Job,
    to: Option<&TrackTo>,
    register: Registration<'_>,
) -> Result<TrackedExport, TrackedExportError> {
    let tracker = to.map(|to| to.open(run, "export", true)).transpose()?;
    let registered = match (&tracker, register.name) {
        (Some(t), Some(name)) => {
            Some(
                t.register(name)
                    .map_err(|source| TrackedExportError::Register {
                        name: name.to_string(),
                        source,
                    })?,
            )
        }
        _ => None,
    };
    opts.version = model_version
        .or(registered.as_ref().map(|v| v.version))
        .unwrap_or(1);
    opts.registry = registered.as_ref().map(|v| version_uri(&v.name, v.version));
    let exported =
        export::export(run, out, &opts, job).map_err(|source| TrackedExportError::Export {
            run: run.to_path_buf(),
            out: out.to_path_buf(),
            source,
        });
    let pending = match (&tracker, &exported) {
        (Some(t), Ok(m)) => log_export(t, m, out, registered.as_ref(), register.alias)?,
        (Some(t), Err(_)) => {
            if let Some(v) = &registered {
                // Nothing was logged to it: take the reserved version back.
                let _ = t.client.delete_model_version(&v.name, v.version);
            }
            t.abandon_logged_model();
            t.end("FAILED")
        }
        (None, _) => None,
    };
    Ok(TrackedExport {
        manifest: exported?,
        registered,
        pending,
    })
}

/// The artifact directory as the run's MLflow Model `model/`, its accuracy as metrics, then the
/// alias. Ends the run.
fn log_export(
    t: &Tracker,
    m: &Manifest,
    dir: &Path,
    registered: Option<&ModelVersion>,
    alias: Option<&str>,
) -> Result<Option<String>, TrackError> {
    let form = &m.quantization.form;
    t.log(
        vec![Metric::now(
            format!("export_{form}_val_accuracy"),
            m.quantization.accuracy,
            0,
        )],
        Vec::new(),
        vec![kv(format!("kestrel.export.{form}"), m.name.as_str())],
    );
    t.log_model(dir, m)?;
    if let (Some(v), Some(alias)) = (registered, alias) {
        t.submit(Op::SetAlias {
            name: v.name.clone(),
            alias: alias.to_string(),
            version: v.version,
        });
    }
    Ok(t.end("FINISHED"))
}
