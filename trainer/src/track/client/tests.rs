use super::*;

#[test]
fn artifact_roots() {
    let p = |u: &str| match ArtifactRoot::parse(u).unwrap() {
        ArtifactRoot::Proxied(p) => format!("proxied {p}"),
        ArtifactRoot::Local(p) => format!("local {}", p.display()),
    };
    assert_eq!(
        p("mlflow-artifacts:/1/abc/artifacts"),
        "proxied 1/abc/artifacts"
    );
    assert_eq!(
        p("mlflow-artifacts://h:5000/1/abc/artifacts/"),
        "proxied 1/abc/artifacts"
    );
    assert_eq!(p("file:///srv/mlruns/1/abc"), "local /srv/mlruns/1/abc");
    let e = ArtifactRoot::parse("s3://bucket/x")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--serve-artifacts"), "{e}");
}

#[test]
fn listed_names_must_be_plain() {
    assert_eq!(
        safe_name("1/abc/artifacts/model/model.onnx"),
        Some("model.onnx")
    );
    assert_eq!(safe_name("x/.."), None);
    assert_eq!(safe_name("x/"), None);
    assert_eq!(encode_path("1/a b/c%"), "1/a%20b/c%25");
}

#[test]
fn model_versions_parse_the_version_string_and_drop_an_empty_run_id() {
    let v = model_version(&json!({
        "name": "faces", "version": "12", "source": "models:/m-1", "run_id": ""
    }))
    .unwrap();
    let want = ModelVersion {
        name: "faces".into(),
        version: 12,
        source: "models:/m-1".into(),
        run_id: None,
    };
    assert_eq!(v, want);
    // A number where MLflow sends a string, and no source: still read.
    let v = model_version(&json!({ "name": "faces", "version": 3, "run_id": "r9" })).unwrap();
    assert_eq!(
        (v.version, v.run_id.as_deref(), v.source.as_str()),
        (3, Some("r9"), "")
    );
    let e = model_version(&json!({ "name": "faces", "version": "v2" })).unwrap_err();
    assert!(
        matches!(&e, TrackError::Unsupported(m) if m == "model version \"v2\" is not a number"),
        "{e}"
    );
}
